//! What the conformance suite does not see of `iree`: a second load of the same model compiles
//! nothing (the module comes from the disk cache) and runs the same, here on a task system of one
//! worker (`--threads 1`). Parity with the reference,
//! chunked prefill, truncate, fork and the end of the context are conformance cases
//! (`tests/conformance.rs`), and the call planning behind them is `graph-engine`'s, shared with
//! every StableHLO runtime.
//!
//! The compiler library is installed into `.seam/py-iree` on first use (pip). If that is not
//! possible here (no network), the test prints why and returns.

use backend_iree::compiler::ensure_compiler_library;
use backend_iree::IreeBackend;
use llama_model::random::{tiny_config, write_random_checkpoint};
use session_api::{Engine, LoadRequest, SessionOptions, WeightFormat};

#[test]
fn a_second_load_comes_from_the_module_cache() {
    if let Err(e) = ensure_compiler_library() {
        eprintln!("SKIPPED a_second_load_comes_from_the_module_cache: {e}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(), 7).unwrap();
    let mut request = LoadRequest::new(dir.path(), WeightFormat::Int4);
    request.max_context = Some(48);
    let greedy = |engine: &dyn Engine| {
        let mut session = engine.new_session(SessionOptions::default()).unwrap();
        let mut tokens = vec![session.prefill(&[1, 17, 42, 99, 200, 3]).unwrap().token];
        for _ in 0..8 {
            tokens.push(session.decode(*tokens.last().unwrap()).unwrap().token);
        }
        tokens
    };
    let first = IreeBackend.load_engine(&request).unwrap();
    request.threads = Some(0);
    let zero = IreeBackend.load_engine(&request).err().expect("zero threads is refused");
    assert_eq!(zero.kind(), session_api::ErrorKind::InvalidInput, "{zero}");
    request.threads = Some(1);
    let second = IreeBackend.load_engine(&request).unwrap();
    let report = second.compile_report();
    assert_eq!((report.compiled, report.from_cache > 0), (0, true), "the second load compiled: {report:?}");
    assert_eq!(greedy(&first), greedy(&second));
}
