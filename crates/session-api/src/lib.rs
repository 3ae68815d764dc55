//! # session-api: the contract between seam and a piece of hardware
//!
//! A backend is a factory ([`Backend`]) registered with [`register_backend!`]. It reports whether it
//! can run on this machine ([`Availability`]), and loads a model directory into an [`Engine`], which
//! holds the weights once. An engine creates any number of [`Session`]s; a session owns exactly one
//! sequence's state (its KV cache) and its sampler, and speaks token ids in and token ids out.
//!
//! Everything above a session is written once, here, for every backend: the generation driver
//! ([`generate::generate`]) with EOS ids, token limits, stop strings and cancellation, its async
//! wrapper ([`async_session`]), and [`stats::GenerationStats`].
//!
//! Optional operations (truncate, fork, logits, embeddings input, sampling beyond greedy) are
//! described by [`Capabilities`]; a request for one that a backend lacks is refused with
//! [`SeamError::Unsupported`], never silently ignored.
//!
//! ## The rules, once
//! A backend implements [`SessionSteps`] (the raw steps); every session a caller gets is a
//! [`CheckedSession`] around them, made by `new_session` on `dyn Engine`. Argument checks,
//! poisoning, `NotPrefilled`, capability refusal, the position and sampling live there, so no
//! backend re-implements (or drifts from) them.
//!
//! ## Errors and poisoning
//! Every fallible call returns [`SeamError`], whose [`SeamError::kind`] is stable. After a failed
//! `prefill` or `decode` (for any reason other than a rejected argument that was checked before any
//! state changed) the session is **poisoned**: every further `prefill`/`decode` fails with
//! [`SeamError::Poisoned`] until [`Session::reset`] is called.

pub mod async_session;
pub mod backend;
pub mod batch;
pub mod capabilities;
pub mod error;
pub mod generate;
pub mod logprobs;
pub mod registry;
pub mod sampling;
pub mod session;
pub mod stats;

pub use backend::{Availability, Backend, DeviceInfo, DeviceKind, Engine, EngineInfo, LoadProgress, LoadRequest};
pub use batch::{BatchEntry, BatchedStep};
pub use capabilities::{Capabilities, InputKinds, KvOps, SamplingModes, StateKind, WeightFormat};
pub use error::{ErrorKind, Result, SeamError};
pub use registry::{find_backend, find_backend_with, registered_backends, BackendRegistration, RegisteredBackend};
pub use sampling::{Penalties, Sampler, SamplingConfig};
pub use session::{
    CheckedSession, RawStep, ScoredStep, Session, SessionLimits, SessionOptions, SessionSteps, StepInput, StepOutput,
};

/// Version of this contract, stamped on every registry entry ([`BackendRegistration::api_version`]).
///
/// It cannot tell a binary that two contracts are linked into it: each copy of session-api has
/// its own registry, and a backend registered through one copy is stamped with that copy's
/// version and is invisible to the other copy's [`registered_backends`]. What catches two copies
/// (two sources of seam's crates, such as a git dependency beside a path one, or two versions) is
/// the link: see [`ONE_SESSION_API_PER_BINARY`]. Within one binary every entry made by
/// [`register_backend!`] therefore carries this same version; the registry still refuses an entry
/// built by hand with another one.
pub const API_VERSION: u32 = 1;

/// A symbol every copy of session-api defines under the same unmangled name, and every registry
/// entry and [`registered_backends`] refer to. A binary that links two copies of this crate would
/// have two registries, and the backends registered through the copy its caller does not use
/// would silently be missing; instead it fails to link, with a duplicate-symbol error whose name
/// says what happened (`duplicate symbol:
/// seam_session_api_linked_twice__take_every_seam_crate_from_one_source_with_cargo_patch` from
/// lld, `multiple definition of …` from GNU ld; `scripts/two-sources-check.sh` shows it). The fix
/// is one source for every seam crate (`[patch]`, see docs/adding-a-backend.md, section 3);
/// `cargo tree -d` lists a crate built twice.
#[export_name = "seam_session_api_linked_twice__take_every_seam_crate_from_one_source_with_cargo_patch"]
#[used]
pub static ONE_SESSION_API_PER_BINARY: u8 = 1;

#[doc(hidden)]
pub use inventory;
