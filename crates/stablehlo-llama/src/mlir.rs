//! A small typed builder for StableHLO in MLIR's generic operation form.
//!
//! Why generic form: it is one syntax for every operation (`"stablehlo.op"(operands) {attrs} :
//! (types) -> types`), stable across StableHLO versions, and accepted by every MLIR parser that
//! knows the dialect; the pretty forms differ per operation and have changed between releases.
//! Every builder method computes the result type itself, so a shape mistake in the graph code is
//! caught here (as a panic: it is a bug of this crate, never a user error) rather than as an
//! unreadable compiler diagnostic.

use std::fmt::Write;

/// Element types the graphs use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32,
    F16,
    I32,
    /// Packed int4 bytes. Declared signed so that no unsigned type reaches the compiler; nibbles
    /// are extracted with a logical shift and a mask, which read the same bits either way.
    I8,
    /// Predicates (`compare` results).
    I1,
    /// Unsigned 4-bit integers, XLA's packed sub-byte type: only ever made by
    /// [`FnBuilder::bytes_as_nibbles`] inside a graph, never an argument or a result.
    U4,
}

impl Elem {
    /// The MLIR spelling.
    pub fn mlir(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::F16 => "f16",
            Elem::I32 => "i32",
            Elem::I8 => "i8",
            Elem::I1 => "i1",
            Elem::U4 => "ui4",
        }
    }
}

/// A ranked tensor type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ty {
    pub dims: Vec<usize>,
    pub elem: Elem,
}

impl Ty {
    /// `tensor<d0xd1x...xelem>`.
    pub fn new(dims: &[usize], elem: Elem) -> Ty {
        Ty { dims: dims.to_vec(), elem }
    }

    /// The MLIR spelling, e.g. `tensor<4x64xf32>` or `tensor<i32>`.
    pub fn mlir(&self) -> String {
        let mut s = String::from("tensor<");
        for d in &self.dims {
            write!(s, "{d}x").unwrap();
        }
        s.push_str(self.elem.mlir());
        s.push('>');
        s
    }

    fn count(&self) -> usize {
        self.dims.iter().product()
    }
}

/// An SSA value with its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Val {
    pub name: String,
    pub ty: Ty,
}

impl Val {
    pub fn dims(&self) -> &[usize] {
        &self.ty.dims
    }
    pub fn elem(&self) -> Elem {
        self.ty.elem
    }
    pub fn rank(&self) -> usize {
        self.ty.dims.len()
    }
}

/// The attributes of a call of `target` with XLA's typed-FFI convention and no attributes of its
/// own.
fn custom_call_attrs(target: &str) -> String {
    format!("api_version = 4 : i32, backend_config = {{}}, call_target_name = \"{target}\"")
}

/// Reductions the graphs need.
#[derive(Debug, Clone, Copy)]
pub enum Reduction {
    Sum,
    Max,
    Min,
}

/// Comparison directions.
#[derive(Debug, Clone, Copy)]
pub enum Cmp {
    Eq,
    Le,
    Lt,
}

fn i64_array(values: &[usize]) -> String {
    let items: Vec<String> = values.iter().map(|v| v.to_string()).collect();
    if items.is_empty() {
        "array<i64>".to_string()
    } else {
        format!("array<i64: {}>", items.join(", "))
    }
}

fn list(values: &[usize]) -> String {
    let items: Vec<String> = values.iter().map(|v| v.to_string()).collect();
    format!("[{}]", items.join(", "))
}

/// A float constant written as its exact bit pattern, so that no decimal round trip can change it.
fn f32_literal(x: f32) -> String {
    format!("0x{:08X}", x.to_bits())
}

/// The body of one `func.func`, built operation by operation.
#[derive(Debug, Default)]
pub struct FnBuilder {
    body: String,
    next: usize,
    /// When set, [`FnBuilder::custom_call`] emits IREE dispatches and records their executables
    /// here ([`FnBuilder::dispatch_kernels_into`]).
    dispatches: Option<KernelDispatches>,
    /// Whether [`FnBuilder::dot_general`] asks for full-precision products
    /// ([`FnBuilder::highest_precision_dots`]).
    highest_precision: bool,
}

impl FnBuilder {
    /// Every later [`FnBuilder::dot_general`] asks the compiler for f32 products (StableHLO's
    /// `precision_config` `HIGHEST` on both operands), where it may otherwise multiply in a lower
    /// precision (XLA on an NVIDIA GPU: TF32, 10-bit mantissas).
    pub fn highest_precision_dots(&mut self) {
        self.highest_precision = true;
    }

    /// A builder whose first SSA names follow the function's arguments.
    pub fn new() -> FnBuilder {
        FnBuilder::default()
    }

    /// A comment line in the body (ignored by the parser, read by people and snapshot diffs).
    pub fn comment(&mut self, text: &str) {
        writeln!(self.body, "    // {text}").unwrap();
    }

    /// Emits one operation with one result and returns the result.
    fn op(&mut self, name: &str, operands: &[&Val], attrs: &str, ty: Ty) -> Val {
        self.op_results(name, operands, attrs, &[ty]).remove(0)
    }

    /// Emits one operation with the results `tys` (one at least) and returns them: `%n` for a
    /// lone result, else `%n:k` whose results are `%n#0`, `%n#1`, ...
    fn op_results(&mut self, name: &str, operands: &[&Val], attrs: &str, tys: &[Ty]) -> Vec<Val> {
        assert!(!tys.is_empty(), "stablehlo.{name} with no result");
        let result = format!("%{}", self.next);
        self.next += 1;
        let names: Vec<&str> = operands.iter().map(|v| v.name.as_str()).collect();
        let types: Vec<String> = operands.iter().map(|v| v.ty.mlir()).collect();
        let attrs = if attrs.is_empty() { String::new() } else { format!(" {{{attrs}}}") };
        let (declared, results) = match tys {
            [ty] => (result.clone(), ty.mlir()),
            _ => (
                format!("{result}:{}", tys.len()),
                format!("({})", tys.iter().map(Ty::mlir).collect::<Vec<_>>().join(", ")),
            ),
        };
        writeln!(
            self.body,
            "    {declared} = \"stablehlo.{name}\"({}){attrs} : ({}) -> {results}",
            names.join(", "),
            types.join(", "),
        )
        .unwrap();
        match tys {
            [ty] => vec![Val { name: result, ty: ty.clone() }],
            _ => tys.iter().enumerate().map(|(i, ty)| Val { name: format!("{result}#{i}"), ty: ty.clone() }).collect(),
        }
    }

    /// A call of a function the runtime provides (`stablehlo.custom_call` with XLA's typed-FFI
    /// calling convention, `api_version = 4`, no attributes): `target` reads `operands` and
    /// returns one array of type `ty`. Only a runtime that registered `target` can compile it.
    pub fn custom_call(&mut self, target: &str, operands: &[&Val], ty: Ty) -> Val {
        if let Some(dispatches) = &mut self.dispatches {
            let (export, workload) = dispatches.export_for(target, operands, std::slice::from_ref(&ty), &[]);
            return self.flow_dispatch(&export, workload, operands, vec![ty], &[]).remove(0);
        }
        self.op("custom_call", operands, &custom_call_attrs(target), ty)
    }

    /// [`FnBuilder::custom_call`] with several results, `tys` (an IREE dispatch with a binding per
    /// result, or an XLA custom call returning a tuple); where `offsets` is not empty, the
    /// operands are read at those offsets, as [`FnBuilder::custom_call_at`] reads them (IREE's
    /// form only).
    pub fn custom_call_results(&mut self, target: &str, operands: &[&Val], offsets: &[usize], tys: &[Ty]) -> Vec<Val> {
        if let Some(dispatches) = &mut self.dispatches {
            let (export, workload) = dispatches.export_for(target, operands, tys, offsets);
            return self.flow_dispatch(&export, workload, operands, tys.to_vec(), &[]);
        }
        assert!(offsets.iter().all(|&o| o == 0), "{target}: a call at operand offsets is IREE's form only");
        self.op_results("custom_call", operands, &custom_call_attrs(target), tys)
    }

    /// [`FnBuilder::custom_call`] as an IREE kernel dispatch whose import sees operand `i` from
    /// element `offsets[i]` on (absent or 0: from its start), as though that operand were its
    /// part there: one layer's part of an argument stacked over the layers, which the dispatch
    /// binds whole (a slice in the graph would be a copy, ADR 0037). IREE's form only.
    pub fn custom_call_at(&mut self, target: &str, operands: &[&Val], offsets: &[usize], ty: Ty) -> Val {
        let Some(dispatches) = &mut self.dispatches else {
            panic!("{target}: a dispatch at operand offsets is IREE's form only");
        };
        let (export, workload) = dispatches.export_for(target, operands, std::slice::from_ref(&ty), offsets);
        self.flow_dispatch(&export, workload, operands, vec![ty], &[]).remove(0)
    }

    /// [`FnBuilder::custom_call`] with several results, `tys`, where each `(result, operand)`
    /// of `aliases` says that the result is the operand updated in place
    /// (`output_operand_aliases`: the runtime hands the call the operand's buffer as the
    /// result's, copying the operand first only where something else still reads it). XLA's
    /// form only: IREE's dispatches of the kernels return one array each.
    pub fn custom_call_aliased(
        &mut self,
        target: &str,
        operands: &[&Val],
        tys: &[Ty],
        aliases: &[(usize, usize)],
    ) -> Vec<Val> {
        assert!(self.dispatches.is_none(), "{target}: IREE's kernel dispatches return one array");
        let aliases: Vec<String> = aliases
            .iter()
            .map(|(result, operand)| {
                format!(
                    "#stablehlo.output_operand_alias<output_tuple_indices = [{result}], operand_index = {operand}, \
                     operand_tuple_indices = []>"
                )
            })
            .collect();
        let attrs = format!("{}, output_operand_aliases = [{}]", custom_call_attrs(target), aliases.join(", "));
        self.op_results("custom_call", operands, &attrs, tys)
    }

    /// An IREE kernel dispatch ([`FnBuilder::dispatch_kernels_into`]) of `target` over
    /// `operands` that returns one new array of type `ty` (if any) and updates the operands `tied`
    /// in place: the results are the new array, then each tied operand as the dispatch left it
    /// (`flow.dispatch ... -> (ty, %operand, ...)`). A tied operand is one read-write binding of
    /// the dispatch, so the import writes into the buffer it reads (IREE copies the operand first
    /// only where something else still reads its old contents). The import's parameters are the
    /// operands' and the new array's, as for [`FnBuilder::custom_call`].
    pub fn dispatch_tied(&mut self, target: &str, operands: &[&Val], ty: Option<Ty>, tied: &[usize]) -> Vec<Val> {
        let Some(dispatches) = &mut self.dispatches else {
            panic!("{target}: a dispatch with tied operands is IREE's form only");
        };
        assert!(ty.is_some() || !tied.is_empty(), "{target}: a dispatch with no result");
        let tys: Vec<Ty> = ty.into_iter().collect();
        let (export, workload) = dispatches.export_for(target, operands, &tys, &[]);
        self.flow_dispatch(&export, workload, operands, tys, tied)
    }

    /// From now on, [`FnBuilder::custom_call`] emits IREE dispatches of kernel executables,
    /// adding the executables it needs to `dispatches` (see [`KernelDispatches`]).
    pub fn dispatch_kernels_into(&mut self, dispatches: KernelDispatches) {
        self.dispatches = Some(dispatches);
    }

    /// The kernel executables this function's dispatches need (with those it was given).
    pub fn take_dispatches(&mut self) -> Option<KernelDispatches> {
        self.dispatches.take()
    }

    /// `flow.dispatch @seam_kernels::@export[workload](operands) -> ty`, with several new arrays
    /// `-> (ty_0, ty_1, ...)`, or with operands `tied` `-> (ty, ..., %operand, ...)` (`tys` may be
    /// empty then): the workload is what the export's workgroups share (see [`KernelDispatches`]).
    /// Returns the new arrays, then the tied operands' results.
    fn flow_dispatch(
        &mut self,
        export: &str,
        extent: usize,
        operands: &[&Val],
        new: Vec<Ty>,
        tied: &[usize],
    ) -> Vec<Val> {
        let workload = format!("%{}", self.next);
        self.next += 1;
        writeln!(self.body, "    {workload} = arith.constant {extent} : index").unwrap();
        let result = format!("%{}", self.next);
        self.next += 1;
        let names: Vec<&str> = operands.iter().map(|v| v.name.as_str()).collect();
        let types: Vec<String> = operands.iter().map(|v| v.ty.mlir()).collect();
        let tys: Vec<Ty> = new.iter().cloned().chain(tied.iter().map(|&i| operands[i].ty.clone())).collect();
        let (declared, results) = match (&new[..], tied) {
            ([ty], []) => (result.clone(), ty.mlir()),
            _ => {
                let results: Vec<String> =
                    new.iter().map(Ty::mlir).chain(tied.iter().map(|&i| operands[i].name.clone())).collect();
                (format!("{result}:{}", tys.len()), format!("({})", results.join(", ")))
            }
        };
        writeln!(
            self.body,
            "    {declared} = flow.dispatch @{KERNEL_EXECUTABLE}::@{export}[{workload}]({}) : ({}) -> {results}",
            names.join(", "),
            types.join(", "),
        )
        .unwrap();
        if tys.len() == 1 && tied.is_empty() {
            return vec![Val { name: result, ty: tys[0].clone() }];
        }
        tys.into_iter().enumerate().map(|(i, ty)| Val { name: format!("{result}#{i}"), ty }).collect()
    }

    /// A splat f32 constant of shape `dims`.
    pub fn const_f32(&mut self, x: f32, dims: &[usize]) -> Val {
        let ty = Ty::new(dims, Elem::F32);
        self.op("constant", &[], &format!("value = dense<{}> : {}", f32_literal(x), ty.mlir()), ty)
    }

    /// An f32 vector constant, written as exact bit patterns.
    pub fn const_f32_vec(&mut self, xs: &[f32]) -> Val {
        let ty = Ty::new(&[xs.len()], Elem::F32);
        let items: Vec<String> = xs.iter().map(|&x| f32_literal(x)).collect();
        self.op("constant", &[], &format!("value = dense<[{}]> : {}", items.join(", "), ty.mlir()), ty)
    }

    /// A splat integer constant (`elem` is I32 or I8).
    pub fn const_int(&mut self, x: i64, elem: Elem, dims: &[usize]) -> Val {
        assert!(matches!(elem, Elem::I32 | Elem::I8), "integer constant of type {elem:?}");
        let ty = Ty::new(dims, elem);
        self.op("constant", &[], &format!("value = dense<{x}> : {}", ty.mlir()), ty)
    }

    fn binary(&mut self, name: &str, a: &Val, b: &Val) -> Val {
        assert_eq!(a.ty, b.ty, "{name} of mismatched operands");
        let ty = a.ty.clone();
        self.op(name, &[a, b], "", ty)
    }

    pub fn add(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("add", a, b)
    }
    pub fn sub(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("subtract", a, b)
    }
    pub fn mul(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("multiply", a, b)
    }
    pub fn div(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("divide", a, b)
    }
    pub fn and(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("and", a, b)
    }
    pub fn shift_right_logical(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("shift_right_logical", a, b)
    }
    pub fn shift_right_arithmetic(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("shift_right_arithmetic", a, b)
    }
    pub fn shift_left(&mut self, a: &Val, b: &Val) -> Val {
        self.binary("shift_left", a, b)
    }

    /// The bytes of `a` (i8, last dimension 4) as one i32 each, that dimension absorbed; byte 0
    /// is the least significant (the little-endian order XLA and IREE use on every target seam
    /// runs on).
    pub fn bytes_as_words(&mut self, a: &Val) -> Val {
        assert_eq!(a.elem(), Elem::I8);
        assert_eq!(a.dims().last(), Some(&4), "bytes_as_words of {:?}", a.dims());
        let dims = &a.dims()[..a.rank() - 1];
        self.op("bitcast_convert", &[a], "", Ty::new(dims, Elem::I32))
    }

    /// Packed bytes (`i8 [..., n]`) as their nibbles (`ui4 [..., n, 2]`), the low nibble of each
    /// byte first (as StableHLO's bitcast to a narrower type orders them, and as seam packs int4:
    /// input `2i` in the low nibble).
    pub fn bytes_as_nibbles(&mut self, a: &Val) -> Val {
        assert_eq!(a.elem(), Elem::I8);
        let mut dims = a.dims().to_vec();
        dims.push(2);
        self.op("bitcast_convert", &[a], "", Ty::new(&dims, Elem::U4))
    }

    fn unary(&mut self, name: &str, a: &Val) -> Val {
        let ty = a.ty.clone();
        self.op(name, &[a], "", ty)
    }

    pub fn neg(&mut self, a: &Val) -> Val {
        self.unary("negate", a)
    }
    pub fn exp(&mut self, a: &Val) -> Val {
        self.unary("exponential", a)
    }
    pub fn sqrt(&mut self, a: &Val) -> Val {
        self.unary("sqrt", a)
    }
    pub fn cos(&mut self, a: &Val) -> Val {
        self.unary("cosine", a)
    }
    pub fn sin(&mut self, a: &Val) -> Val {
        self.unary("sine", a)
    }

    /// Element type conversion.
    pub fn convert(&mut self, a: &Val, elem: Elem) -> Val {
        if a.elem() == elem {
            return a.clone();
        }
        self.op("convert", &[a], "", Ty::new(a.dims(), elem))
    }

    /// Same elements, new shape.
    pub fn reshape(&mut self, a: &Val, dims: &[usize]) -> Val {
        let ty = Ty::new(dims, a.elem());
        assert_eq!(ty.count(), a.ty.count(), "reshape {:?} to {dims:?}", a.dims());
        if a.dims() == dims {
            return a.clone();
        }
        self.op("reshape", &[a], "", ty)
    }

    /// Result dimension `i` is operand dimension `perm[i]`.
    pub fn transpose(&mut self, a: &Val, perm: &[usize]) -> Val {
        assert_eq!(perm.len(), a.rank());
        let dims: Vec<usize> = perm.iter().map(|&p| a.dims()[p]).collect();
        self.op("transpose", &[a], &format!("permutation = {}", i64_array(perm)), Ty::new(&dims, a.elem()))
    }

    /// Operand dimension `i` becomes result dimension `map[i]`.
    pub fn broadcast(&mut self, a: &Val, dims: &[usize], map: &[usize]) -> Val {
        assert_eq!(map.len(), a.rank());
        for (i, &m) in map.iter().enumerate() {
            assert!(a.dims()[i] == dims[m] || a.dims()[i] == 1, "broadcast {:?} to {dims:?} by {map:?}", a.dims());
        }
        if a.dims() == dims {
            return a.clone();
        }
        self.op(
            "broadcast_in_dim",
            &[a],
            &format!("broadcast_dimensions = {}", i64_array(map)),
            Ty::new(dims, a.elem()),
        )
    }

    /// `0, 1, 2, ...` along `dim` of an i32 tensor of shape `dims`.
    pub fn iota(&mut self, dims: &[usize], dim: usize) -> Val {
        self.op("iota", &[], &format!("iota_dimension = {dim} : i64"), Ty::new(dims, Elem::I32))
    }

    pub fn compare(&mut self, a: &Val, b: &Val, cmp: Cmp) -> Val {
        assert_eq!(a.ty, b.ty);
        let dir = match cmp {
            Cmp::Eq => "EQ",
            Cmp::Le => "LE",
            Cmp::Lt => "LT",
        };
        self.op(
            "compare",
            &[a, b],
            &format!("comparison_direction = #stablehlo<comparison_direction {dir}>"),
            Ty::new(a.dims(), Elem::I1),
        )
    }

    pub fn select(&mut self, pred: &Val, a: &Val, b: &Val) -> Val {
        assert_eq!(pred.elem(), Elem::I1);
        assert_eq!(pred.dims(), a.dims());
        assert_eq!(a.ty, b.ty);
        let ty = a.ty.clone();
        self.op("select", &[pred, a, b], "", ty)
    }

    /// Static slice `[start, limit)` per dimension, stride 1.
    pub fn slice(&mut self, a: &Val, start: &[usize], limit: &[usize]) -> Val {
        assert!(start.len() == a.rank() && limit.len() == a.rank());
        let dims: Vec<usize> = start.iter().zip(limit).map(|(s, l)| l - s).collect();
        let attrs = format!(
            "limit_indices = {}, start_indices = {}, strides = {}",
            i64_array(limit),
            i64_array(start),
            i64_array(&vec![1; a.rank()])
        );
        self.op("slice", &[a], &attrs, Ty::new(&dims, a.elem()))
    }

    /// Runtime-offset slice; `starts` are scalar i32 values.
    pub fn dynamic_slice(&mut self, a: &Val, starts: &[&Val], sizes: &[usize]) -> Val {
        assert!(starts.len() == a.rank() && sizes.len() == a.rank());
        let mut operands = vec![a];
        operands.extend_from_slice(starts);
        self.op("dynamic_slice", &operands, &format!("slice_sizes = {}", i64_array(sizes)), Ty::new(sizes, a.elem()))
    }

    /// `a` with `update` written at runtime offsets `starts` (scalar i32 values).
    pub fn dynamic_update_slice(&mut self, a: &Val, update: &Val, starts: &[&Val]) -> Val {
        assert!(starts.len() == a.rank() && update.rank() == a.rank() && update.elem() == a.elem());
        let mut operands = vec![a, update];
        operands.extend_from_slice(starts);
        let ty = a.ty.clone();
        self.op("dynamic_update_slice", &operands, "", ty)
    }

    pub fn concatenate(&mut self, parts: &[&Val], dim: usize) -> Val {
        let first = parts[0];
        let mut dims = first.dims().to_vec();
        dims[dim] = parts.iter().map(|p| p.dims()[dim]).sum();
        self.op("concatenate", parts, &format!("dimension = {dim} : i64"), Ty::new(&dims, first.elem()))
    }

    /// Rows `ids` (i32 `[n]`) of the 2-D `table`: `[n, table.cols]`.
    pub fn gather_rows(&mut self, table: &Val, ids: &Val) -> Val {
        assert_eq!(table.rank(), 2);
        assert_eq!(ids.rank(), 1);
        let n = ids.dims()[0];
        let ids2 = self.reshape(ids, &[n, 1]);
        let cols = table.dims()[1];
        let attrs = format!(
            "dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = {}",
            i64_array(&[1, cols])
        );
        self.op("gather", &[table, &ids2], &attrs, Ty::new(&[n, cols], table.elem()))
    }

    /// Rows `ids` (i32 `[n]`) of the 2-D `table` `[R, C]` held in panels of 16 rows whose rows
    /// interleave in chunks of `chunk` elements (`cpu_kernels::int8_to_panels`: chunks of four
    /// codes; one for per-group scales): as a `[R / 16, C / chunk, 16, chunk]` array, row `i` is
    /// `[i / 16, :, i % 16, :]`. `R` is a multiple of 16. The result is `[n, C]`, row-major.
    pub fn gather_panel_rows(&mut self, table: &Val, ids: &Val, chunk: usize) -> Val {
        assert_eq!(table.rank(), 2);
        assert_eq!(ids.rank(), 1);
        let (rows, cols) = (table.dims()[0], table.dims()[1]);
        let panel = cpu_kernels::PANEL_ROWS;
        assert!(rows % panel == 0 && cols % chunk == 0, "whole panels of whole chunks");
        let n = ids.dims()[0];
        let view = self.reshape(table, &[rows / panel, cols / chunk, panel, chunk]);
        let width = self.const_int(panel as i64, ids.elem(), &[n]);
        let panel_of = self.binary("divide", ids, &width);
        let lane = self.binary("remainder", ids, &width);
        let panel_of = self.reshape(&panel_of, &[n, 1]);
        let lane = self.reshape(&lane, &[n, 1]);
        let starts = self.concatenate(&[&panel_of, &lane], 1);
        let attrs = format!(
            "dimension_numbers = #stablehlo.gather<offset_dims = [1, 2], collapsed_slice_dims = [0, 2], start_index_map = [0, 2], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = {}",
            i64_array(&[1, cols / chunk, 1, chunk])
        );
        let gathered = self.op("gather", &[&view, &starts], &attrs, Ty::new(&[n, cols / chunk, chunk], table.elem()));
        self.reshape(&gathered, &[n, cols])
    }

    /// Columns `ids` (i32 `[n]`) of the 2-D `table`, as rows: `[n, table.rows]`.
    pub fn gather_columns(&mut self, table: &Val, ids: &Val) -> Val {
        assert_eq!(table.rank(), 2);
        assert_eq!(ids.rank(), 1);
        let n = ids.dims()[0];
        let ids2 = self.reshape(ids, &[n, 1]);
        let rows = table.dims()[0];
        let attrs = format!(
            "dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [1], start_index_map = [1], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = {}",
            i64_array(&[rows, 1])
        );
        self.op("gather", &[table, &ids2], &attrs, Ty::new(&[n, rows], table.elem()))
    }

    /// `dot_general`: result dims are the batch dims, then lhs free dims, then rhs free dims.
    pub fn dot_general(
        &mut self,
        a: &Val,
        b: &Val,
        batch: (&[usize], &[usize]),
        contract: (&[usize], &[usize]),
    ) -> Val {
        assert_eq!(a.elem(), b.elem());
        for (&i, &j) in batch.0.iter().zip(batch.1).chain(contract.0.iter().zip(contract.1)) {
            assert_eq!(a.dims()[i], b.dims()[j], "dot_general of {:?} and {:?}", a.dims(), b.dims());
        }
        let mut dims: Vec<usize> = batch.0.iter().map(|&i| a.dims()[i]).collect();
        let free = |v: &Val, used: Vec<usize>| -> Vec<usize> {
            (0..v.rank()).filter(|d| !used.contains(d)).map(|d| v.dims()[d]).collect()
        };
        dims.extend(free(a, [batch.0, contract.0].concat()));
        dims.extend(free(b, [batch.1, contract.1].concat()));
        let mut attrs = format!(
            "dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = {}, rhs_batching_dimensions = {}, lhs_contracting_dimensions = {}, rhs_contracting_dimensions = {}>",
            list(batch.0),
            list(batch.1),
            list(contract.0),
            list(contract.1)
        );
        if self.highest_precision {
            attrs.push_str(", precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]");
        }
        self.op("dot_general", &[a, b], &attrs, Ty::new(&dims, a.elem()))
    }

    /// Reduces `dims` of `a` away.
    pub fn reduce(&mut self, a: &Val, dims: &[usize], kind: Reduction) -> Val {
        let elem = a.elem();
        let init = match (kind, elem) {
            (Reduction::Sum, Elem::F32) => self.const_f32(0.0, &[]),
            (Reduction::Sum, Elem::I32) => self.const_int(0, Elem::I32, &[]),
            (Reduction::Max, Elem::F32) => self.const_f32(f32::NEG_INFINITY, &[]),
            (Reduction::Min, Elem::I32) => self.const_int(i32::MAX as i64, Elem::I32, &[]),
            other => panic!("reduction {other:?} is not used by the graphs"),
        };
        let op = match kind {
            Reduction::Sum => "add",
            Reduction::Max => "maximum",
            Reduction::Min => "minimum",
        };
        let out_dims: Vec<usize> = (0..a.rank()).filter(|d| !dims.contains(d)).map(|d| a.dims()[d]).collect();
        let ty = Ty::new(&out_dims, elem);
        let result = format!("%{}", self.next);
        self.next += 1;
        let scalar = Ty::new(&[], elem).mlir();
        writeln!(self.body, "    {result} = \"stablehlo.reduce\"({}, {}) ({{", a.name, init.name).unwrap();
        writeln!(self.body, "    ^bb0(%lhs: {scalar}, %rhs: {scalar}):").unwrap();
        writeln!(self.body, "      %r = \"stablehlo.{op}\"(%lhs, %rhs) : ({scalar}, {scalar}) -> {scalar}").unwrap();
        writeln!(self.body, "      \"stablehlo.return\"(%r) : ({scalar}) -> ()").unwrap();
        writeln!(
            self.body,
            "    }}) {{dimensions = {}}} : ({}, {scalar}) -> {}",
            i64_array(dims),
            a.ty.mlir(),
            ty.mlir()
        )
        .unwrap();
        Val { name: result, ty }
    }

    /// Index of the first maximum of a 1-D f32 tensor as an i32 scalar, or of each row of a 2-D
    /// one as `i32[rows]`.
    ///
    /// One variadic reduction over (value, index) pairs whose combiner keeps the larger value, and
    /// the smaller index on a tie: associative and commutative, so any reduction order gives the
    /// first maximum, and the compiler needs no vocab-sized temporary (a max reduction followed by
    /// a compare/select/min reduction made IREE fuse them into one dispatch with a 192 KiB stack
    /// buffer at vocab 49152, over its 32 KiB limit). An all `-inf` input gives 0, like
    /// `session_api::sampling::argmax`.
    pub fn argmax(&mut self, v: &Val) -> Val {
        assert!((1..=2).contains(&v.rank()) && v.elem() == Elem::F32);
        let last = v.rank() - 1;
        let ids = self.iota(v.dims(), last);
        let init_v = self.const_f32(f32::NEG_INFINITY, &[]);
        let init_i = self.const_int(0, Elem::I32, &[]);
        let result = format!("%{}", self.next);
        self.next += 1;
        let (f, i, b) = ("tensor<f32>", "tensor<i32>", "tensor<i1>");
        let out_dims = &v.dims()[..last];
        let (out_f, out_i) = (Ty::new(out_dims, Elem::F32).mlir(), Ty::new(out_dims, Elem::I32).mlir());
        let cmp = |dir: &str| format!("{{comparison_direction = #stablehlo<comparison_direction {dir}>}}");
        let lines = [
            format!(
                "    {result}:2 = \"stablehlo.reduce\"({}, {}, {}, {}) ({{",
                v.name, ids.name, init_v.name, init_i.name
            ),
            format!("    ^bb0(%av: {f}, %ai: {i}, %bv: {f}, %bi: {i}):"),
            format!("      %gt = \"stablehlo.compare\"(%av, %bv) {} : ({f}, {f}) -> {b}", cmp("GT")),
            format!("      %eq = \"stablehlo.compare\"(%av, %bv) {} : ({f}, {f}) -> {b}", cmp("EQ")),
            format!("      %lt = \"stablehlo.compare\"(%ai, %bi) {} : ({i}, {i}) -> {b}", cmp("LT")),
            format!("      %tie = \"stablehlo.and\"(%eq, %lt) : ({b}, {b}) -> {b}"),
            format!("      %a = \"stablehlo.or\"(%gt, %tie) : ({b}, {b}) -> {b}"),
            format!("      %v = \"stablehlo.select\"(%a, %av, %bv) : ({b}, {f}, {f}) -> {f}"),
            format!("      %i = \"stablehlo.select\"(%a, %ai, %bi) : ({b}, {i}, {i}) -> {i}"),
            format!("      \"stablehlo.return\"(%v, %i) : ({f}, {i}) -> ()"),
            format!(
                "    }}) {{dimensions = array<i64: {last}>}} : ({}, {}, {f}, {i}) -> ({out_f}, {out_i})",
                v.ty.mlir(),
                ids.ty.mlir()
            ),
        ];
        for line in lines {
            writeln!(self.body, "{line}").unwrap();
        }
        Val { name: format!("{result}#1"), ty: Ty::new(out_dims, Elem::I32) }
    }

    /// A `stablehlo.while` loop carrying `init`. `cond` gets the carried values and returns the
    /// i1 predicate; `body` gets them and returns their next values (same types). Both regions
    /// may use values defined earlier in the function (implicit capture).
    pub fn while_loop(
        &mut self,
        init: &[&Val],
        cond: impl FnOnce(&mut FnBuilder, &[Val]) -> Val,
        body: impl FnOnce(&mut FnBuilder, &[Val]) -> Vec<Val>,
    ) -> Vec<Val> {
        let id = self.next;
        self.next += 1;
        let types: Vec<String> = init.iter().map(|v| v.ty.mlir()).collect();
        let block_args = |prefix: &str| -> Vec<Val> {
            init.iter().enumerate().map(|(j, v)| Val { name: format!("%{prefix}{id}_{j}"), ty: v.ty.clone() }).collect()
        };
        let signature = |vals: &[Val]| -> String {
            vals.iter().map(|v| format!("{}: {}", v.name, v.ty.mlir())).collect::<Vec<_>>().join(", ")
        };
        let (cond_args, body_args) = (block_args("c"), block_args("b"));
        let outer = std::mem::take(&mut self.body);
        let predicate = cond(self, &cond_args);
        assert!(predicate.elem() == Elem::I1 && predicate.rank() == 0, "a while condition is a scalar i1");
        let cond_text = std::mem::take(&mut self.body);
        let next = body(self, &body_args);
        let body_text = std::mem::replace(&mut self.body, outer);
        assert_eq!(
            next.iter().map(|v| &v.ty).collect::<Vec<_>>(),
            init.iter().map(|v| &v.ty).collect::<Vec<_>>(),
            "a loop body keeps its types"
        );
        let indent = |text: &str| text.lines().map(|l| format!("  {l}\n")).collect::<String>();
        let names: Vec<&str> = init.iter().map(|v| v.name.as_str()).collect();
        let next_names: Vec<&str> = next.iter().map(|v| v.name.as_str()).collect();
        let all = types.join(", ");
        writeln!(self.body, "    %{id}:{} = \"stablehlo.while\"({}) ({{", init.len(), names.join(", ")).unwrap();
        writeln!(self.body, "    ^bb0({}):", signature(&cond_args)).unwrap();
        self.body.push_str(&indent(&cond_text));
        writeln!(self.body, "      \"stablehlo.return\"({}) : (tensor<i1>) -> ()", predicate.name).unwrap();
        writeln!(self.body, "    }}, {{").unwrap();
        writeln!(self.body, "    ^bb0({}):", signature(&body_args)).unwrap();
        self.body.push_str(&indent(&body_text));
        writeln!(self.body, "      \"stablehlo.return\"({}) : ({all}) -> ()", next_names.join(", ")).unwrap();
        writeln!(self.body, "    }}) : ({all}) -> ({all})").unwrap();
        init.iter().enumerate().map(|(j, v)| Val { name: format!("%{id}#{j}"), ty: v.ty.clone() }).collect()
    }

    /// Finishes the function: `func.func @name(args) -> (results)` with this body.
    pub fn finish(self, name: &str, args: &[FnArg], results: &[&Val]) -> String {
        let mut s = String::new();
        writeln!(s, "  func.func @{name}(").unwrap();
        for (i, arg) in args.iter().enumerate() {
            let sep = if i + 1 == args.len() { "" } else { "," };
            let attrs = if arg.attrs.is_empty() { String::new() } else { format!(" {{{}}}", arg.attrs) };
            writeln!(s, "      {}: {}{attrs}{sep} // {}", arg.val.name, arg.val.ty.mlir(), arg.doc).unwrap();
        }
        let types: Vec<String> = results.iter().map(|r| r.ty.mlir()).collect();
        writeln!(s, "  ) -> ({}) {{", types.join(", ")).unwrap();
        s.push_str(&self.body);
        let names: Vec<&str> = results.iter().map(|r| r.name.as_str()).collect();
        writeln!(s, "    func.return {} : {}", names.join(", "), types.join(", ")).unwrap();
        writeln!(s, "  }}").unwrap();
        s
    }
}

/// A function argument with its attributes (MLIR text, may be empty) and a comment.
#[derive(Debug, Clone)]
pub struct FnArg {
    pub val: Val,
    pub attrs: String,
    pub doc: String,
}

/// A function argument `%argN` of type `ty`.
pub fn arg(index: usize, ty: Ty) -> Val {
    Val { name: format!("%arg{index}"), ty }
}

/// The name of the module-level executable holding the kernel dispatch exports.
pub const KERNEL_EXECUTABLE: &str = "seam_kernels";

/// Most workgroups one kernel dispatch is cut into: a few per core of the machines seam runs
/// on, so that IREE's workers share the rows evenly without paying for many tiny calls.
const MAX_WORKGROUPS: usize = 8;

/// Fewest output rows a workgroup computes.
const MIN_ROWS_PER_WORKGROUP: usize = 64;

/// What a workgroup's share of output rows is a multiple of (but for a matrix's last): the rows
/// of a panel of int4 or int8 weights, which cannot be cut.
pub(crate) const SHARE_ROWS: usize = 16;

/// The kernel calls of a module in IREE's form ([`crate::KernelCalls::IreeDispatch`]): one
/// export of the `stream.executable @seam_kernels` per distinct target and operand shapes.
///
/// An export's workgroups each call the executable import named like the target with the
/// operands' buffers and one share of the work, in this calling convention (the runtime's
/// import reads it as a packed struct of pointer-sized words): for each operand, then each
/// result, a bare pointer and its element offset; then the call's shape words (`Split`); then
/// `first` and `count`, this workgroup's share.
///
/// - A linear target's shape words are `tokens` (the result's rows), `k` (the first operand's
///   columns) and `n` (the result's columns); a workgroup computes output columns
///   `first..first + count` of every token. One whose input is a decode attention's parts
///   ([`crate::KernelInput::AttentionParts`]) has `k` the merged input's columns, then a fourth
///   word, `heads`. A grouped one ([`crate::linear_group_target`]) has `tokens`, `k`, then each
///   result's columns `n_0, n_1, ...`; its workgroups share the columns of all the results in
///   turn (column `c` of the second result is share column `n_0 + c`). One that ropes its query
///   and key has a last word, `head_dim`, and its shares are whole heads.
/// - A causal attention's ([`crate::ATTENTION_CAUSAL_TARGET`]) are `tokens`, `heads`, `kv_heads`,
///   `head_dim`, `capacity` (the cache's positions) and `cache_bytes` (the bytes of a cache
///   element: 4 for f32, 2 for f16); a workgroup computes query heads `first..first + count` of
///   every token.
/// - A decode's attention ([`crate::attention_decode_many_target`], one sequence or a batch's)
///   are `sequences`, `heads`, `kv_heads`, `head_dim`, `capacity` and `cache_bytes`; the
///   workgroups share the `sequences * kv_heads * ATTENTION_DECODE_PARTS` spans, unit `u` being
///   span `u % P` of KV head `u / P % kv_heads` of sequence `u / (P * kv_heads)`, each served for
///   all of that KV head's query heads with one read of its keys and values (ADR 0031).
/// - The entries' writes ([`crate::WRITE_ENTRIES_TARGET`]) are `tokens`, `kv_heads`, `head_dim`,
///   `capacity` and `cache_bytes`; a workgroup writes KV heads `first..first + count`.
/// - The greedy tokens ([`crate::ARGMAX_TARGET`]) are `rows` and `cols` of the logits; a
///   workgroup takes rows `first..first + count`.
///
/// A dispatch with tied operands ([`FnBuilder::dispatch_tied`]) passes each of them once, as an
/// operand, which the import may write in place; its new array, if any, is the result. A
/// dispatch at operand offsets ([`FnBuilder::custom_call_at`]) has exports of its own that add
/// each operand's offset to the element offset they pass, so the import sees that part only.
#[derive(Debug, Default, Clone)]
pub struct KernelDispatches {
    /// The exports, in first-use order.
    exports: Vec<Export>,
}

/// One export of the kernel executable.
#[derive(Debug, Clone)]
struct Export {
    name: String,
    target: String,
    operands: Vec<Ty>,
    /// The new arrays (none for a dispatch that only updates its tied operands).
    results: Vec<Ty>,
    /// Where the import's view of each operand starts, in elements (empty: every operand from
    /// its start; [`FnBuilder::custom_call_at`]).
    offsets: Vec<usize>,
}

/// How one kernel call is shared among workgroups, and the shape words its import receives.
struct Split {
    /// The extent the workgroups share (output columns, or query heads), the dispatch's workload.
    extent: usize,
    /// Most of it one workgroup takes.
    per_group: usize,
    /// The call's shape words (see [`KernelDispatches`]).
    words: Vec<usize>,
}

impl Split {
    fn of(target: &str, operands: &[Ty], results: &[Ty]) -> Split {
        if target == crate::WRITE_ENTRIES_TARGET {
            // operands k and v [T, KVH, D], position, rows, keys [KVH, D, C], values: a workgroup
            // writes one KV head's entries.
            let (tokens, kv_heads, head_dim) = (operands[0].dims[0], operands[0].dims[1], operands[0].dims[2]);
            let capacity = operands[4].dims[2];
            let words = vec![tokens, kv_heads, head_dim, capacity, cache_bytes(&operands[4])];
            return Split { extent: kv_heads, per_group: 1, words };
        }
        let dims = &results.first().expect("the kernel dispatches but the entries' writes return a new array").dims;
        if target.starts_with(crate::ATTENTION_DECODE_MANY_TARGET) {
            // operands q [S, H, D], positions, the new keys and values [S, KVH, D], then keys
            // [KVH, D, C] and values per sequence; result the parts. A workgroup takes one span
            // of one KV head of one sequence.
            let (sequences, heads, head_dim) = (operands[0].dims[0], operands[0].dims[1], operands[0].dims[2]);
            let keys = &operands[4].dims;
            return Split {
                extent: sequences * keys[0] * crate::ATTENTION_DECODE_PARTS,
                per_group: 1,
                words: vec![sequences, heads, keys[0], head_dim, keys[2], cache_bytes(&operands[4])],
            };
        }
        if target == crate::ARGMAX_TARGET {
            // operand logits [R, V], result [R]: a workgroup takes one row.
            let (rows, cols) = (operands[0].dims[0], operands[0].dims[1]);
            return Split { extent: rows, per_group: 1, words: vec![rows, cols] };
        }
        if target == crate::ATTENTION_CAUSAL_TARGET {
            // result [T, H, D]; keys [KVH, D, C]. A workgroup takes one query head.
            let (tokens, heads, head_dim) = (dims[0], dims[1], dims[2]);
            let keys = &operands[1].dims;
            let words = vec![tokens, heads, keys[0], head_dim, keys[2], cache_bytes(&operands[1])];
            return Split { extent: heads, per_group: 1, words };
        }
        let n = dims[dims.len() - 1];
        let tokens: usize = dims[..dims.len() - 1].iter().product();
        if results.len() > 1 {
            // A grouped linear target's results [T, n_i]: the workgroups share their columns,
            // the first matrix's rows then the next's. One that ropes its first two results
            // takes the tables [T, D] just before `rows` and shares whole heads of D.
            let ns: Vec<usize> = results.iter().map(|r| r.dims[r.dims.len() - 1]).collect();
            let extent = ns.iter().sum();
            let k = operands[0].dims[operands[0].dims.len() - 1];
            let mut words: Vec<usize> = [tokens, k].into_iter().chain(ns).collect();
            let mut align = SHARE_ROWS;
            if target.ends_with(crate::graph::ROPE_SUFFIX) {
                let head_dim = operands[operands.len() - 2].dims[1];
                words.push(head_dim);
                align = lcm(SHARE_ROWS, head_dim);
            }
            return Split { extent, per_group: rows_per_workgroup_of(extent, align), words };
        }
        if target.contains(crate::graph::ATTENTION_PARTS_INPUT) {
            // parts [T, P * H, 2 + D]: the product's input is the merged [T, H * D].
            let parts = &operands[0].dims;
            let heads = parts[1] / crate::ATTENTION_DECODE_PARTS;
            let k = heads * (parts[2] - 2);
            return Split { extent: n, per_group: rows_per_workgroup(n), words: vec![tokens, k, n, heads] };
        }
        let k = operands[0].dims[operands[0].dims.len() - 1];
        Split { extent: n, per_group: rows_per_workgroup(n), words: vec![tokens, k, n] }
    }
}

/// The bytes of one element of a KV cache operand (the attention imports read f32 or f16).
fn cache_bytes(cache: &Ty) -> usize {
    match cache.elem {
        Elem::F16 => 2,
        _ => 4,
    }
}

impl KernelDispatches {
    /// The export for `target` over these operands (made on first use), and the workload of a
    /// dispatch of it.
    fn export_for(&mut self, target: &str, operands: &[&Val], results: &[Ty], offsets: &[usize]) -> (String, usize) {
        let types: Vec<Ty> = operands.iter().map(|v| v.ty.clone()).collect();
        let extent = Split::of(target, &types, results).extent;
        // Trailing zero offsets are no offsets: one export serves both spellings.
        let used = offsets.iter().rposition(|&o| o != 0).map_or(0, |i| i + 1);
        let offsets = offsets[..used].to_vec();
        if let Some(export) = self
            .exports
            .iter()
            .find(|e| e.target == target && e.operands == types && e.results == results && e.offsets == offsets)
        {
            return (export.name.clone(), extent);
        }
        let name = format!("{target}_{}", self.exports.len());
        self.exports.push(Export {
            name: name.clone(),
            target: target.to_string(),
            operands: types,
            results: results.to_vec(),
            offsets,
        });
        (name, extent)
    }

    /// The `stream.executable` defining every export (empty when the module dispatches none).
    pub fn executable(&self) -> String {
        if self.exports.is_empty() {
            return String::new();
        }
        let mut s = String::new();
        writeln!(s, "  stream.executable private @{KERNEL_EXECUTABLE} {{").unwrap();
        for Export { name, target, operands, results, .. } in &self.exports {
            let per_group = Split::of(target, operands, results).per_group;
            writeln!(
                s,
                "    stream.executable.export public @{name} workgroups(%workload: index) -> (index, index, index) {{"
            )
            .unwrap();
            writeln!(s, "      %groups = affine.apply affine_map<()[s0] -> (s0 ceildiv {per_group})>()[%workload]")
                .unwrap();
            writeln!(s, "      %one = arith.constant 1 : index").unwrap();
            writeln!(s, "      stream.return %groups, %one, %one : index, index, index").unwrap();
            writeln!(s, "    }}").unwrap();
        }
        writeln!(s, "    builtin.module {{").unwrap();
        let mut declared: Vec<&str> = Vec::new();
        for Export { target, operands, results, .. } in &self.exports {
            if declared.contains(&target.as_str()) {
                continue;
            }
            declared.push(target);
            let params = import_params(target, operands, results);
            writeln!(s, "      func.func private @{target}({params}) attributes {{llvm.bareptr = true}}").unwrap();
        }
        for export in &self.exports {
            s.push_str(&export_function(export));
        }
        writeln!(s, "    }}").unwrap();
        writeln!(s, "  }}").unwrap();
        s
    }
}

/// Output rows per workgroup for `n` rows: at most [`MAX_WORKGROUPS`] groups of at least
/// [`MIN_ROWS_PER_WORKGROUP`] rows (a multiple of 16), or all of them in one.
fn rows_per_workgroup(n: usize) -> usize {
    rows_per_workgroup_of(n, SHARE_ROWS)
}

/// [`rows_per_workgroup`] in multiples of `align` rows.
fn rows_per_workgroup_of(n: usize, align: usize) -> usize {
    let groups = n.div_ceil(MIN_ROWS_PER_WORKGROUP).clamp(1, MAX_WORKGROUPS);
    n.div_ceil(groups).next_multiple_of(align).min(n.max(1))
}

/// The least common multiple of `a` and `b` (both non-zero).
fn lcm(a: usize, b: usize) -> usize {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x * b
}

/// The parameter types of a target's import, in the calling convention of [`KernelDispatches`]:
/// a bare pointer and an element offset for each operand and the result, then the shape words,
/// `first` and `count`, each an `index`.
fn import_params(target: &str, operands: &[Ty], results: &[Ty]) -> String {
    let words = Split::of(target, operands, results).words.len() + 2;
    let mut params: Vec<String> =
        operands.iter().chain(results).map(|t| format!("memref<{}>, index", t.elem.mlir())).collect();
    params.extend(std::iter::repeat_n("index".to_string(), words));
    params.join(", ")
}

/// `memref<d0xd1x...xelem, strided<[...], offset: ?>>`: dense row-major at an offset known only
/// at run time, because IREE may place several operands in one buffer and pass each one's
/// offset to the dispatch (a static offset-0 type would drop it).
fn memref(ty: &Ty) -> String {
    let mut s = String::from("memref<");
    for d in &ty.dims {
        write!(s, "{d}x").unwrap();
    }
    s.push_str(ty.elem.mlir());
    let strides: Vec<String> =
        (0..ty.dims.len()).map(|i| ty.dims[i + 1..].iter().product::<usize>().to_string()).collect();
    write!(s, ", strided<[{}], offset: ?>>", strides.join(", ")).unwrap();
    s
}

/// The function of one export: its bindings as memrefs, their base pointers and offsets, and
/// the import call for this workgroup's share.
fn export_function(export: &Export) -> String {
    let Export { name, target, operands, results, offsets } = export;
    let Split { extent, per_group, words } = Split::of(target, operands, results);
    let all: Vec<&Ty> = operands.iter().chain(results).collect();
    let mut s = String::new();
    let bindings: Vec<String> = (0..all.len()).map(|i| format!("%b{i}: !stream.binding")).collect();
    writeln!(s, "      func.func @{name}({}) {{", bindings.join(", ")).unwrap();
    writeln!(s, "        %c0 = arith.constant 0 : index").unwrap();
    writeln!(s, "        %id = stream.dispatch.workgroup.id[0] : index").unwrap();
    writeln!(s, "        %first = affine.apply affine_map<()[s0] -> (s0 * {per_group})>()[%id]").unwrap();
    writeln!(s, "        %count = affine.min affine_map<()[s0] -> ({per_group}, {extent} - s0 * {per_group})>()[%id]")
        .unwrap();
    for (i, word) in words.iter().enumerate() {
        writeln!(s, "        %w{i} = arith.constant {word} : index").unwrap();
    }
    let mut args = Vec::new();
    for (i, ty) in all.iter().enumerate() {
        let m = memref(ty);
        writeln!(s, "        %m{i} = stream.binding.subspan %b{i}[%c0] : !stream.binding -> {m}").unwrap();
        let rank = ty.dims.len();
        let mut outs = vec![format!("%p{i}"), format!("%o{i}")];
        let mut out_types = vec![format!("memref<{}>", ty.elem.mlir()), "index".to_string()];
        for j in 0..2 * rank {
            outs.push(format!("%x{i}_{j}"));
            out_types.push("index".to_string());
        }
        writeln!(
            s,
            "        {} = memref.extract_strided_metadata %m{i} : {m} -> {}",
            outs.join(", "),
            out_types.join(", ")
        )
        .unwrap();
        match offsets.get(i) {
            Some(&offset) if offset != 0 => {
                writeln!(s, "        %d{i} = arith.constant {offset} : index").unwrap();
                writeln!(s, "        %q{i} = arith.addi %o{i}, %d{i} : index").unwrap();
                args.push(format!("%p{i}, %q{i}"));
            }
            _ => args.push(format!("%p{i}, %o{i}")),
        }
    }
    args.extend((0..words.len()).map(|i| format!("%w{i}")));
    args.push("%first, %count".to_string());
    let params = import_params(target, operands, results);
    writeln!(s, "        func.call @{target}({}) : ({params}) -> ()", args.join(", ")).unwrap();
    writeln!(s, "        return").unwrap();
    writeln!(s, "      }}").unwrap();
    s
}
