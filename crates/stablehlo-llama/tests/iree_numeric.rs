//! Numeric check of the emitted graphs against the reference backend, through IREE 3.13's
//! command-line tools (the Rust IREE runtime is the next step of the IREE backend).
//!
//! The test installs `iree-base-compiler==3.13.0` and `iree-base-runtime==3.13.0` into
//! `.seam/py-iree` (once), compiles the tiny model's graphs with `iree-compile` for llvm-cpu, and
//! runs a session with `iree-run-module`: a prompt through the prefill graph, decode steps, an
//! extension through the prefill graph at a non-zero offset, more decode steps. The KV cache goes
//! from one call to the next as `.npy` files. Every step's logits and greedy token are compared
//! with `backend_reference` on the same weights, teacher-forced with the reference's tokens.
//! If pip cannot install the wheels (no network), the test prints why and returns.
//!
//! `iree_prefill_from_embeddings_matches_token_prefill` feeds the same session through the
//! `prefill_embeddings_{T}` graphs, with rows taken from the model's own embedding table, and
//! checks them against the token graphs and the reference.

use backend_reference::{EngineOptions, ReferenceEngine};
use llama_model::{LlamaWeights, Matrix};
use session_api::{SessionOptions, WeightFormat};
use stablehlo_llama::{
    cache_arg_shapes, emit_module, graph_host_args, ArgDtype, GraphKind, GraphOptions, GraphSpec, LayerMode,
    StorageDtype,
};
use std::path::{Path, PathBuf};
use std::process::Command;

const MAX_CONTEXT: usize = 32;
const BUCKET: usize = 8;

/// `llama_model::home::py_iree_dir()` (`.seam/py-iree`) with both wheels installed, or why not. Installed once per test binary:
/// the tests run on parallel threads and must not run two pip installs into one folder.
fn iree_tools() -> Result<PathBuf, String> {
    static TOOLS: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    TOOLS.get_or_init(install_iree_tools).clone()
}

fn install_iree_tools() -> Result<PathBuf, String> {
    // The same install the IREE backends use, so a checkout installs the wheels once.
    let dir = llama_model::home::py_iree_dir();
    let ready = |d: &Path| d.join("bin/iree-compile").is_file() && d.join("bin/iree-run-module").is_file();
    if ready(&dir) {
        return Ok(dir);
    }
    let status = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--target"])
        .arg(&dir)
        .args(["iree-base-compiler==3.13.0", "iree-base-runtime==3.13.0"])
        .status()
        .map_err(|e| format!("running python3 -m pip: {e}"))?;
    if !status.success() || !ready(&dir) {
        return Err(format!(
            "pip install --target {} iree-base-compiler==3.13.0 iree-base-runtime==3.13.0 failed ({status})",
            dir.display()
        ));
    }
    Ok(dir)
}

fn tool(dir: &Path, name: &str) -> Command {
    let mut cmd = Command::new(dir.join("bin").join(name));
    cmd.env("PYTHONPATH", dir);
    cmd
}

fn run(mut cmd: Command) {
    let out = cmd.output().expect("starting an IREE tool");
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A minimal `.npy` (version 1.0) writer.
fn write_npy(path: &Path, descr: &str, shape: &[usize], data: &[u8]) {
    let shape = match shape {
        [] => "()".to_string(),
        [n] => format!("({n},)"),
        dims => format!("({})", dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

/// The data bytes of an `.npy` file and its `descr`.
fn read_npy(path: &Path) -> (String, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..6], b"\x93NUMPY", "{} is not .npy", path.display());
    let (len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize, 12),
    };
    let header = std::str::from_utf8(&bytes[start..start + len]).unwrap();
    let descr = header.split("'descr': '").nth(1).unwrap().split('\'').next().unwrap().to_string();
    (descr, bytes[start + len..].to_vec())
}

fn read_f32s(path: &Path) -> Vec<f32> {
    let (descr, data) = read_npy(path);
    assert_eq!(descr, "<f4");
    data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn read_i32(path: &Path) -> i32 {
    let (descr, data) = read_npy(path);
    assert_eq!(descr, "<i4");
    i32::from_le_bytes(data[..4].try_into().unwrap())
}

fn int4_weights(w: &LlamaWeights) -> LlamaWeights {
    let q = |m: &Matrix| Matrix::Int4(m.to_int4().unwrap());
    let mut out = w.clone();
    out.embed = q(&w.embed);
    out.lm_head = w.lm_head.as_ref().map(q);
    for (o, l) in out.layers.iter_mut().zip(&w.layers) {
        for (dst, src) in [
            (&mut o.wq, &l.wq),
            (&mut o.wk, &l.wk),
            (&mut o.wv, &l.wv),
            (&mut o.wo, &l.wo),
            (&mut o.w_gate, &l.w_gate),
            (&mut o.w_up, &l.w_up),
            (&mut o.w_down, &l.w_down),
        ] {
            *dst = q(src);
        }
    }
    out
}

/// One IREE session over the compiled module: the cache lives in `.npy` files between calls (two
/// stacked caches, or two per layer: `cache_arg_shapes`).
struct IreeSession<'a> {
    tools: &'a Path,
    dir: &'a Path,
    vmfb: PathBuf,
    weight_inputs: Vec<String>,
    caches: Vec<PathBuf>,
    hidden: usize,
    position: usize,
    calls: usize,
}

impl IreeSession<'_> {
    /// Feeds `tokens` (one: `@decode_logits`; more: `@prefill_8_logits`) and returns the greedy
    /// token and the logits of the last one.
    fn step(&mut self, tokens: &[u32]) -> (u32, Vec<f32>) {
        let mut inputs = Vec::new();
        let function = if tokens.len() == 1 {
            inputs.push(format!("--input=1xi32={}", tokens[0]));
            inputs.push(format!("--input=i32={}", self.position));
            "decode_logits".to_string()
        } else {
            let mut padded: Vec<String> = tokens.iter().map(u32::to_string).collect();
            padded.resize(BUCKET, "0".into());
            inputs.push(format!("--input={BUCKET}xi32={}", padded.join(",")));
            inputs.push(format!("--input=i32={}", self.position));
            inputs.push(format!("--input=i32={}", tokens.len()));
            format!("prefill_{BUCKET}_logits")
        };
        self.call(&function, inputs, tokens.len())
    }

    /// Feeds embedding `rows` (`count * hidden` values) through `@prefill_embeddings_{bucket}_logits`,
    /// padded with zero rows, and returns the greedy token and the logits of the last row.
    fn step_embeddings(&mut self, rows: &[f32], bucket: usize) -> (u32, Vec<f32>) {
        let count = rows.len() / self.hidden;
        assert!(count >= 1 && count <= bucket && rows.len() == count * self.hidden);
        let mut padded = rows.to_vec();
        padded.resize(bucket * self.hidden, 0.0);
        let path = self.dir.join(format!("embeddings_{}.npy", self.calls + 1));
        let bytes: Vec<u8> = padded.iter().flat_map(|v| v.to_le_bytes()).collect();
        write_npy(&path, "<f4", &[bucket, self.hidden], &bytes);
        let inputs = vec![
            format!("--input=@{}", path.display()),
            format!("--input=i32={}", self.position),
            format!("--input=i32={count}"),
        ];
        self.call(&format!("prefill_embeddings_{bucket}_logits"), inputs, count)
    }

    /// Runs `function` on `inputs` (those before the caches), the caches and the weights; keeps
    /// the updated caches for the next call and moves the position on by `advance`.
    fn call(&mut self, function: &str, inputs: Vec<String>, advance: usize) -> (u32, Vec<f32>) {
        self.calls += 1;
        let mut cmd = tool(self.tools, "iree-run-module");
        cmd.arg(format!("--module={}", self.vmfb.display())).arg("--device=local-task");
        cmd.arg(format!("--function={function}")).args(inputs);
        for cache in &self.caches {
            cmd.arg(format!("--input=@{}", cache.display()));
        }
        cmd.args(&self.weight_inputs);
        let out = |name: &str| self.dir.join(format!("{name}_{}.npy", self.calls));
        let token = out("token");
        let caches: Vec<PathBuf> = (0..self.caches.len()).map(|i| out(&format!("cache{i}"))).collect();
        let logits = out("logits");
        for p in std::iter::once(&token).chain(&caches).chain([&logits]) {
            cmd.arg(format!("--output=@{}", p.display()));
        }
        run(cmd);
        self.caches = caches;
        self.position += advance;
        (read_i32(&token) as u32, read_f32s(&logits))
    }
}

/// Compiles `specs` for `weights` with `options` into `dir` and opens a session on an empty cache.
fn iree_session<'a>(
    tools: &'a Path,
    dir: &'a Path,
    weights: &LlamaWeights,
    options: &GraphOptions,
    specs: &[GraphSpec],
) -> IreeSession<'a> {
    let config = &weights.config;
    let mlir = dir.join("model.mlir");
    std::fs::write(&mlir, emit_module(config, options, specs).unwrap()).unwrap();
    let vmfb = dir.join("model.vmfb");
    let mut compile = tool(tools, "iree-compile");
    compile.arg(&mlir).args(["--iree-hal-target-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host", "-o"]).arg(&vmfb);
    run(compile);

    let mut weight_inputs = Vec::new();
    for (i, arg) in graph_host_args(weights, options).unwrap().iter().enumerate() {
        let descr = match arg.spec.dtype {
            ArgDtype::F32 => "<f4",
            ArgDtype::F16 => "<f2",
            ArgDtype::I32 => "<i4",
            ArgDtype::I8 => "|i1",
        };
        let path = dir.join(format!("w{i}.npy"));
        write_npy(&path, descr, &arg.spec.shape, &arg.bytes);
        weight_inputs.push(format!("--input=@{}", path.display()));
    }
    // Stacked: keys [layers, kv_heads, head_dim, max_context], values [layers, kv_heads,
    // max_context, head_dim]; per layer the same without the first dimension.
    assert_eq!(options.cache, StorageDtype::F16, "the cache files are written as f16");
    let caches = cache_arg_shapes(config, options)
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let path = dir.join(format!("cache{i}_0.npy"));
            write_npy(&path, "<f2", shape, &vec![0u8; shape.iter().product::<usize>() * 2]);
            path
        })
        .collect();
    IreeSession { tools, dir, vmfb, weight_inputs, caches, hidden: config.hidden_size, position: 0, calls: 0 }
}

fn graph_options(format: WeightFormat, layers: LayerMode) -> GraphOptions {
    GraphOptions { layers, ..GraphOptions::new(MAX_CONTEXT, format) }
}

/// Largest absolute difference of two logit vectors of the same length.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max)
}

/// Runs the session script on IREE and the reference; returns the largest logit difference.
fn compare(tools: &Path, weights: &LlamaWeights, format: WeightFormat, layers: LayerMode) -> f32 {
    let dir = tempfile::tempdir().unwrap();
    let options = graph_options(format, layers);
    let specs = [
        GraphSpec { kind: GraphKind::Decode, logits: true },
        GraphSpec { kind: GraphKind::Prefill { bucket: BUCKET }, logits: true },
    ];
    let mut iree = iree_session(tools, dir.path(), weights, &options, &specs);

    let engine = ReferenceEngine::from_weights(weights, EngineOptions::default()).unwrap();
    let mut reference = engine.session(SessionOptions { return_logits: true, ..Default::default() }).unwrap();

    // Prompt (5 of 8), 3 decode steps, an extension of 3 tokens at offset 8, 3 decode steps.
    let prompt = [1u32, 17, 42, 99, 200];
    let extension = [7u32, 250, 3];
    let mut worst = 0.0f32;
    let mut check = |what: &str, iree: (u32, Vec<f32>), reference: session_api::StepOutput| -> u32 {
        let ref_logits = reference.logits.unwrap();
        let diff = iree.1.iter().zip(&ref_logits).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        eprintln!(
            "{format} {layers:?} {what}: max |logit diff| {diff:.2e}, tokens iree {} reference {}",
            iree.0, reference.token
        );
        assert_eq!(iree.1.len(), ref_logits.len());
        assert_eq!(iree.0, reference.token, "{format} {what}: greedy token");
        worst = worst.max(diff);
        reference.token
    };
    let mut next = check("prefill", iree.step(&prompt), reference.prefill(&prompt).unwrap());
    for i in 0..3 {
        next = check(&format!("decode {i}"), iree.step(&[next]), reference.decode(next).unwrap());
    }
    next = check("extend", iree.step(&extension), reference.prefill(&extension).unwrap());
    for i in 0..3 {
        next = check(&format!("decode {}", i + 3), iree.step(&[next]), reference.decode(next).unwrap());
    }
    assert_eq!(iree.position, reference.position());
    worst
}

#[test]
fn iree_matches_the_reference_in_f16_and_int4() {
    let tools = match iree_tools() {
        Ok(t) => t,
        Err(reason) => {
            eprintln!("SKIPPED iree_matches_the_reference_in_f16_and_int4: {reason}");
            return;
        }
    };
    // f16 on the Llama-3.2-shaped tiny config (tied head read from the embedding table, llama3
    // rope scaling); int4 on the plain tiny config (untied head, plain rope). Between them every
    // branch of the emitter runs.
    // Both layer layouts: unrolled, and one loop over stacked weights.
    let f16 = llama_model::random::random_weights(&llama_model::random::tiny_llama32_config(), 11).unwrap();
    let plain = llama_model::random::random_weights(&llama_model::random::tiny_config(), 12).unwrap();
    let int4 = int4_weights(&plain);
    for layers in [LayerMode::Unrolled, LayerMode::Loop] {
        let err = compare(&tools, &f16, WeightFormat::F16, layers);
        eprintln!("f16 {layers:?}: worst max |logit diff| {err:.2e}");
        assert!(err < 1e-2, "f16 {layers:?} logits differ by {err}");
        let err = compare(&tools, &int4, WeightFormat::Int4, layers);
        eprintln!("int4 {layers:?}: worst max |logit diff| {err:.2e}");
        assert!(err < 1e-2, "int4 {layers:?} logits differ by {err}");
    }
}

/// The rows the token graphs would gather for `tokens`, from the model's own table: the f16 table
/// widened to f32, or the int4 table dequantized (`scale * q + bias`).
fn embedding_rows(weights: &LlamaWeights, tokens: &[u32]) -> Vec<f32> {
    let hidden = weights.config.hidden_size;
    let mut rows = vec![0.0f32; tokens.len() * hidden];
    for (row, &token) in rows.chunks_exact_mut(hidden).zip(tokens) {
        weights.embed.row_f32(token as usize, row);
    }
    rows
}

/// One session fed through the embeddings graphs beside one fed the same tokens through the token
/// graphs: a prompt (bucket 8), one row through the 1-row bucket, a decode step, an extension of 3
/// rows at offset 7, a decode step. Every step's logits and greedy token must match the token
/// session's (and the greedy token the reference's). Returns the largest logit difference.
fn compare_embeddings(tools: &Path, weights: &LlamaWeights, format: WeightFormat, layers: LayerMode) -> f32 {
    let dir = tempfile::tempdir().unwrap();
    let options = graph_options(format, layers);
    let specs = [
        GraphSpec { kind: GraphKind::Decode, logits: true },
        GraphSpec { kind: GraphKind::Prefill { bucket: BUCKET }, logits: true },
        GraphSpec { kind: GraphKind::PrefillEmbeddings { bucket: BUCKET }, logits: true },
        GraphSpec { kind: GraphKind::PrefillEmbeddings { bucket: 1 }, logits: true },
    ];
    // One compile serves both sessions; each writes its outputs into its own folder.
    let mut from_tokens = iree_session(tools, dir.path(), weights, &options, &specs);
    let rows_dir = tempfile::tempdir().unwrap();
    let mut from_rows = IreeSession {
        dir: rows_dir.path(),
        vmfb: from_tokens.vmfb.clone(),
        weight_inputs: from_tokens.weight_inputs.clone(),
        caches: from_tokens.caches.clone(),
        ..from_tokens
    };

    let engine = ReferenceEngine::from_weights(weights, EngineOptions::default()).unwrap();
    let mut reference = engine.session(SessionOptions::default()).unwrap();
    let mut worst = 0.0f32;
    let mut check = |what: &str, rows: (u32, Vec<f32>), tokens: (u32, Vec<f32>), reference: u32| {
        let diff = max_diff(&rows.1, &tokens.1);
        let (from_rows, from_tokens) = (rows.0, tokens.0);
        eprintln!("{format} {layers:?} {what}: max |logit diff| embeddings vs tokens {diff:.2e}, tokens {from_rows} / {from_tokens} / reference {reference}");
        assert_eq!(rows.0, tokens.0, "{format} {layers:?} {what}: greedy token from embeddings vs tokens");
        assert_eq!(rows.0, reference, "{format} {layers:?} {what}: greedy token from embeddings vs the reference");
        worst = worst.max(diff);
        rows.0
    };

    let prompt = [1u32, 17, 42, 99, 200];
    let extension = [7u32, 250, 3];
    let mut next = check(
        "prefill",
        from_rows.step_embeddings(&embedding_rows(weights, &prompt), BUCKET),
        from_tokens.step(&prompt),
        reference.prefill(&prompt).unwrap().token,
    );
    next = check(
        "one row",
        from_rows.step_embeddings(&embedding_rows(weights, &[next]), 1),
        from_tokens.step(&[next]),
        reference.decode(next).unwrap().token,
    );
    // The embeddings graphs leave the cache as the token graphs do: decode carries on from it.
    check("decode", from_rows.step(&[next]), from_tokens.step(&[next]), reference.decode(next).unwrap().token);
    next = check(
        "extend",
        from_rows.step_embeddings(&embedding_rows(weights, &extension), BUCKET),
        from_tokens.step(&extension),
        reference.prefill(&extension).unwrap().token,
    );
    check(
        "decode after extend",
        from_rows.step(&[next]),
        from_tokens.step(&[next]),
        reference.decode(next).unwrap().token,
    );
    assert_eq!(from_rows.position, reference.position());
    assert_eq!(from_tokens.position, reference.position());
    worst
}

#[test]
fn iree_prefill_from_embeddings_matches_token_prefill() {
    let tools = match iree_tools() {
        Ok(t) => t,
        Err(reason) => {
            eprintln!("SKIPPED iree_prefill_from_embeddings_matches_token_prefill: {reason}");
            return;
        }
    };
    // As above: f16 on the tied Llama-3.2-shaped config, int4 on the untied plain one.
    let f16 = llama_model::random::random_weights(&llama_model::random::tiny_llama32_config(), 21).unwrap();
    let int4 = int4_weights(&llama_model::random::random_weights(&llama_model::random::tiny_config(), 22).unwrap());
    // The layouts the engines use run the same comparison end to end in the conformance suite
    // (`input.embeddings_*`: `Loop` on iree, `UnrolledCachePerLayer` on pjrt); the third is here.
    for layers in [LayerMode::Unrolled] {
        for (weights, format) in [(&f16, WeightFormat::F16), (&int4, WeightFormat::Int4)] {
            let err = compare_embeddings(&tools, weights, format, layers);
            eprintln!("{format} {layers:?}: embeddings vs tokens, worst max |logit diff| {err:.2e}");
            assert!(err < 1e-2, "{format} {layers:?}: logits from embeddings differ from those from tokens by {err}");
        }
    }
}

/// The KV cache is updated in place: with the graphs' `tf.aliasing_output` attributes IREE 3.13
/// imports the cache buffers as consumed and writes the results into them; without them (the
/// control) it copies both caches into new buffers on every call. Read from the compiler's
/// stream-level IR, where every buffer copy is explicit.
#[test]
fn iree_updates_the_kv_cache_in_place() {
    let tools = match iree_tools() {
        Ok(t) => t,
        Err(reason) => {
            eprintln!("SKIPPED iree_updates_the_kv_cache_in_place: {reason}");
            return;
        }
    };
    let config = llama_model::random::tiny_config();
    for layers in [LayerMode::Unrolled, LayerMode::Loop] {
        // 24 positions: 2 * 2 * 24 * 16 f16 = 3072 bytes per cache, a size no weight has.
        let options = GraphOptions { layers, ..GraphOptions::new(24, WeightFormat::F16) };
        let cache_bytes = config.num_hidden_layers * config.num_key_value_heads * 24 * config.head_dim * 2;
        let text = emit_module(&config, &options, &[GraphSpec { kind: GraphKind::Decode, logits: false }]).unwrap();
        assert!(text.contains("tf.aliasing_output"));
        let control =
            text.replace(" {tf.aliasing_output = 1 : i32}", "").replace(" {tf.aliasing_output = 2 : i32}", "");
        let dir = tempfile::tempdir().unwrap();
        let stream_ir = |name: &str, mlir: &str| -> String {
            let input = dir.path().join(format!("{name}.mlir"));
            let output = dir.path().join(format!("{name}.stream.mlir"));
            std::fs::write(&input, mlir).unwrap();
            let mut cmd = tool(&tools, "iree-compile");
            cmd.arg(&input)
                .args([
                    "--iree-hal-target-backends=llvm-cpu",
                    "--iree-llvmcpu-target-cpu=host",
                    "--compile-to=stream",
                    "-o",
                ])
                .arg(&output);
            run(cmd);
            let ir = std::fs::read_to_string(&output).unwrap();
            // The public wrapper function holds the imports, exports and copies.
            ir[ir.find("util.func public @decode").expect("the exported function")..].to_string()
        };
        let cache_copies = |ir: &str| {
            ir.lines().filter(|l| l.contains("stream.cmd.copy") && l.contains(&format!(", %c{cache_bytes} :"))).count()
        };
        let consumed =
            |ir: &str| ir.lines().filter(|l| l.contains("stream.tensor.import") && l.contains(" consume %arg")).count();

        let aliased = stream_ir(&format!("aliased_{layers:?}"), &text);
        let copied = stream_ir(&format!("control_{layers:?}"), &control);
        eprintln!(
            "{layers:?}: cache copies per decode step: {} with aliasing, {} without",
            cache_copies(&aliased),
            cache_copies(&copied)
        );
        assert_eq!(cache_copies(&copied), 2, "the control must show the copies this test looks for");
        assert_eq!(consumed(&copied), 0);
        assert_eq!(cache_copies(&aliased), 0, "{layers:?}: the cache is copied");
        assert_eq!(consumed(&aliased), 2);
    }
}
