//! The backend registry, filled at link time through `inventory`.
//!
//! Linker pitfall: `inventory` registrations live in the backend crate's object code. If nothing in
//! the final binary references that crate, the linker may drop it together with its registration.
//! A binary that links backends must therefore reference each one (every backend crate exports a
//! `link()` function for exactly this; the `seam` cli calls them at start-up).

use crate::backend::Backend;
use crate::error::{Result, SeamError};
use crate::API_VERSION;

/// One backend's entry in the registry. Create it with [`crate::register_backend!`].
pub struct BackendRegistration {
    /// The contract version the backend was compiled against.
    pub api_version: u32,
    /// The registry name.
    pub name: &'static str,
    /// Builds the backend; must be cheap (no device work until `availability` or `load`).
    pub constructor: fn() -> Box<dyn Backend>,
}

inventory::collect!(BackendRegistration);

/// Registers a backend: `register_backend!("reference", || Box::new(ReferenceBackend::default()));`
#[macro_export]
macro_rules! register_backend {
    ($name:expr, $constructor:expr) => {
        $crate::inventory::submit! {
            $crate::registry::BackendRegistration {
                api_version: $crate::API_VERSION,
                name: $name,
                constructor: $constructor,
            }
        }
    };
}

/// A registry entry as seen by callers.
pub struct RegisteredBackend {
    /// The registry name.
    pub name: &'static str,
    /// The contract version it was built against.
    pub api_version: u32,
    constructor: fn() -> Box<dyn Backend>,
}

impl RegisteredBackend {
    /// Whether it was built against this contract version.
    pub fn is_compatible(&self) -> bool {
        self.api_version == API_VERSION
    }

    /// Instantiates the backend, refusing one built against another contract version.
    pub fn instantiate(&self) -> Result<Box<dyn Backend>> {
        if !self.is_compatible() {
            return Err(SeamError::Unavailable {
                backend: self.name.to_string(),
                reason: format!(
                    "built against session-api version {}, this binary speaks version {API_VERSION}",
                    self.api_version
                ),
            });
        }
        Ok((self.constructor)())
    }
}

/// Every registered backend, sorted by name. Duplicate names keep the first registration.
pub fn registered_backends() -> Vec<RegisteredBackend> {
    let mut all: Vec<RegisteredBackend> = inventory::iter::<BackendRegistration>
        .into_iter()
        .map(|r| RegisteredBackend { name: r.name, api_version: r.api_version, constructor: r.constructor })
        .collect();
    all.sort_by(|a, b| a.name.cmp(b.name));
    all.dedup_by(|a, b| a.name == b.name);
    all
}

/// The backend registered under `name`.
pub fn find_backend(name: &str) -> Result<Box<dyn Backend>> {
    let all = registered_backends();
    match all.iter().find(|b| b.name == name) {
        Some(entry) => entry.instantiate(),
        None => Err(SeamError::UnknownBackend {
            name: name.to_string(),
            known: all.iter().map(|b| b.name).collect::<Vec<_>>().join(", "),
        }),
    }
}
