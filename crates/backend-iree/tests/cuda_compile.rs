//! The graphs `iree-cuda` runs compile for an NVIDIA GPU, in both weight formats and both layer
//! layouts, for `sm_89`: the PTX an H100 gets, IREE 3.13 having no `sm_90` target (see
//! `backend_iree::device::IREE_CUDA_TARGETS`). Compiling needs no GPU: the compiler wheel carries
//! the CUDA target. Running the graphs needs one (and a build with the `cuda` feature); CI has
//! none, so this is what CI can check of the CUDA path.

use backend_iree::compiler::{compile_cached, ensure_compiler_library, CompilerChoice};
use graph_engine::token_graphs;
use graph_engine::CacheOutcome;
use llama_model::random::{tiny_config, tiny_llama32_config};
use session_api::WeightFormat;
use stablehlo_llama::buckets_for_context;
use stablehlo_llama::{emit_module, GraphOptions, LayerMode};
use std::cell::RefCell;

#[test]
fn graphs_compile_for_cuda() {
    let compiler = match ensure_compiler_library() {
        Ok(library) => CompilerChoice::Library(library),
        Err(e) => {
            eprintln!("SKIPPED graphs_compile_for_cuda: {e}");
            return;
        }
    };
    let flags = ["--iree-hal-target-backends=cuda", "--iree-cuda-target=sm_89", "--iree-opt-level=O3"];
    let cases = [
        (tiny_llama32_config(), WeightFormat::F16, LayerMode::Loop),
        (tiny_config(), WeightFormat::Int4, LayerMode::Loop),
        (tiny_config(), WeightFormat::F16, LayerMode::Unrolled),
    ];
    for (config, format, layers) in cases {
        let options = GraphOptions { layers, ..GraphOptions::new(32, format) };
        let text = emit_module(&config, &options, &token_graphs(&buckets_for_context(32))).unwrap();
        let module = RefCell::new(Vec::new());
        compile_cached(&compiler, "cuda test", &text, &flags, |vmfb| {
            *module.borrow_mut() = vmfb;
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{format} {layers:?} graphs did not compile for sm_89: {e}"));
        // A CUDA module embeds PTX for the target; an llvm-cpu one would embed an ELF instead.
        let module = module.into_inner();
        let ptx = module.windows(b".target sm_89".len()).any(|w| w == b".target sm_89");
        assert!(ptx, "{format} {layers:?}: no sm_89 PTX in the module ({} bytes)", module.len());

        // A machine without a compiler (a GPU machine, SEAM_IREE_COMPILER=none) finds the same
        // module in the cache: a CUDA module's key does not depend on the CPU that compiled it.
        let cached = RefCell::new(Vec::new());
        let outcome = compile_cached(&CompilerChoice::CachedOnly, "cuda test", &text, &flags, |vmfb| {
            *cached.borrow_mut() = vmfb;
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{format} {layers:?}: not found without a compiler: {e}"));
        assert_eq!((outcome, cached.into_inner()), (CacheOutcome::Hit, module));
    }
    // A graph nobody compiled is an error naming the cure, not a crash or a silent compile.
    let unknown = "module @never_compiled {}";
    let error = compile_cached(&CompilerChoice::CachedOnly, "unknown", unknown, &flags, |_| Ok(())).unwrap_err();
    assert!(error.to_string().contains("seam compile"), "{error}");
}
