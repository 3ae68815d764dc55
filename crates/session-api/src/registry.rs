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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Availability, Engine, LoadRequest};
    use crate::capabilities::Capabilities;
    use std::sync::Arc;

    struct Dummy;

    impl Backend for Dummy {
        fn name(&self) -> &str {
            "test-dummy"
        }
        fn description(&self) -> &str {
            "a backend that only exists in this test"
        }
        fn availability(&self) -> Availability {
            Availability::Unavailable { reason: "it is a test double".into() }
        }
        fn capabilities(&self) -> Capabilities {
            unreachable!("not called in these tests")
        }
        fn load(&self, _: &LoadRequest) -> Result<Arc<dyn Engine>> {
            Err(SeamError::Unavailable { backend: "test-dummy".into(), reason: "it is a test double".into() })
        }
    }

    crate::register_backend!("test-dummy", || Box::new(Dummy));

    inventory::submit! {
        BackendRegistration { api_version: API_VERSION + 1, name: "test-future", constructor: || Box::new(Dummy) }
    }

    #[test]
    fn finds_registered_backends_by_name() {
        let backend = find_backend("test-dummy").unwrap();
        assert_eq!(backend.name(), "test-dummy");
        assert!(!backend.availability().is_available());
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let err = find_backend("nope").err().unwrap();
        assert_eq!(err.kind(), crate::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("test-dummy"), "{err}");
    }

    #[test]
    fn a_backend_built_for_another_api_version_is_refused() {
        let entry = registered_backends().into_iter().find(|b| b.name == "test-future").unwrap();
        assert!(!entry.is_compatible());
        assert_eq!(entry.instantiate().err().unwrap().kind(), crate::ErrorKind::Unavailable);
    }
}
