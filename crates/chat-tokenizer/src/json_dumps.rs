//! A `tojson` filter that writes what Python's `json.dumps` writes.
//!
//! Hugging Face transformers replaces Jinja's `tojson` with
//! `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)`.
//! minijinja's own `tojson` differs (compact separators, HTML-safe escapes), and a chat template's
//! output is a model's input: one different byte changes the tokens. So this module follows
//! Python's formatting: `", "` and `": "` separators (`","` when indenting), no HTML escaping,
//! `\uXXXX` only for control characters (and all non-ASCII with `ensure_ascii`), floats in
//! Python's `repr` spelling.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// How to lay out the JSON, from the filter's arguments.
struct Layout {
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

/// The `tojson` filter: `value | tojson`, `value | tojson(indent=4)`, and Python's other keyword
/// arguments `ensure_ascii`, `sort_keys`, `separators`.
pub(crate) fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")?.or(indent) {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => Some(indent_string(&v)?),
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let (item_separator, key_separator) = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings"))?;
            match <[String; 2]>::try_from(parts) {
                Ok([item, key]) => (item, key),
                Err(_) => {
                    return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings"))
                }
            }
        }
        // Python's defaults: with an indent, the item separator loses its trailing space.
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    kwargs.assert_all_used()?;
    let layout = Layout { indent, item_separator, key_separator, ensure_ascii, sort_keys };
    let mut out = String::new();
    write_value(&mut out, value, &layout, 0)?;
    Ok(out)
}

/// Python accepts an int (that many spaces; negative means none) or a string as `indent`.
fn indent_string(v: &Value) -> Result<String, Error> {
    if let Some(s) = v.as_str() {
        return Ok(s.to_owned());
    }
    match v.as_i64() {
        Some(n) => Ok(" ".repeat(n.max(0) as usize)),
        None => Err(Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an integer or a string")),
    }
}

fn newline_and_indent(out: &mut String, layout: &Layout, depth: usize) {
    if let Some(unit) = &layout.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(unit);
        }
    }
}

fn write_value(out: &mut String, value: &Value, layout: &Layout, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => out.push_str(&python_float_repr(f64::try_from(value.clone())?)),
        ValueKind::String => write_string(out, value.as_str().unwrap_or_default(), layout.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, '[', ']', &items, layout, depth, |out, item, depth| {
                write_value(out, item, layout, depth)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((key_string(&key)?, item));
            }
            if layout.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, '{', '}', &entries, layout, depth, |out, (key, item), depth| {
                write_string(out, key, layout.ensure_ascii);
                out.push_str(&layout.key_separator);
                write_value(out, item, layout, depth)
            })?;
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of type {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// Writes `[...]` or `{...}` with Python's layout: empty containers stay `[]` / `{}`.
fn write_container<T>(
    out: &mut String,
    open: char,
    close: char,
    items: &[T],
    layout: &Layout,
    depth: usize,
    mut write_item: impl FnMut(&mut String, &T, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if !items.is_empty() {
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&layout.item_separator);
            }
            newline_and_indent(out, layout, depth + 1);
            write_item(out, item, depth + 1)?;
        }
        newline_and_indent(out, layout, depth);
    }
    out.push(close);
    Ok(())
}

/// Python turns non-string keys into strings the way it spells them in JSON.
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::Number if key.is_integer() => Ok(key.to_string()),
        ValueKind::Number => Ok(python_float_repr(f64::try_from(key.clone())?)),
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest round-tripping digits (as Rust's `Debug`), scientific
/// notation below 1e-4 and from 1e16 on with a signed exponent of at least two digits, and
/// `NaN` / `Infinity` as `json.dumps` writes them.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    let debug = format!("{f:?}");
    let Some((mantissa, exponent)) = debug.split_once('e') else {
        return debug;
    };
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let sign = if exponent < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exponent.abs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::Environment;

    fn render(template: &str, ctx: Value) -> String {
        let mut env = Environment::new();
        env.add_filter("tojson", tojson);
        env.render_str(template, ctx).unwrap()
    }

    #[test]
    fn matches_python_json_dumps_defaults() {
        let ctx = minijinja::context! { v => minijinja::value::Serde(serde_json::json!({"name": "f", "args": [1, 2.5, null, true, "a\"b<c>\n"], "empty": {}})) };
        // json.dumps(..., ensure_ascii=False) with serde_json's sorted keys as the insertion order.
        assert_eq!(
            render("{{ v | tojson }}", ctx),
            r#"{"args": [1, 2.5, null, true, "a\"b<c>\n"], "empty": {}, "name": "f"}"#
        );
    }

    #[test]
    fn indents_like_python() {
        let ctx = minijinja::context! { v => minijinja::value::Serde(serde_json::json!({"a": [1, {}], "b": "é"})) };
        assert_eq!(
            render("{{ v | tojson(indent=2) }}", ctx.clone()),
            "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": \"é\"\n}"
        );
        assert_eq!(render("{{ v | tojson(ensure_ascii=true) }}", ctx), r#"{"a": [1, {}], "b": "\u00e9"}"#);
    }

    #[test]
    fn floats_use_python_repr() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e16), "1e+16");
        assert_eq!(python_float_repr(1.5e-7), "1.5e-07");
        assert_eq!(python_float_repr(123456.5), "123456.5");
    }

    #[test]
    fn escapes_control_characters_and_astral_planes() {
        let ctx = minijinja::context! { v => "\u{1}😀" };
        assert_eq!(render("{{ v | tojson }}", ctx.clone()), "\"\\u0001😀\"");
        assert_eq!(render("{{ v | tojson(ensure_ascii=true) }}", ctx), "\"\\u0001\\ud83d\\ude00\"");
    }
}
