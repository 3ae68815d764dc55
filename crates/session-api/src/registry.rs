//! The backend registry, filled at link time through `inventory`.
//!
//! Linker pitfall: `inventory` registrations live in the backend crate's object code. If nothing in
//! the final binary references that crate, the linker may drop it together with its registration.
//! A binary that links backends must therefore reference each one (every backend crate exports a
//! `link()` function for exactly this; the `seam` cli calls them at start-up).
//!
//! One registry per binary: a second copy of this crate would be a second registry, so every
//! entry refers to [`crate::ONE_SESSION_API_PER_BINARY`], whose fixed symbol name makes such a
//! binary fail to link instead of losing backends silently.

use crate::backend::{Availability, Backend, Engine, LoadRequest};
use crate::capabilities::Capabilities;
use crate::error::{Result, SeamError};
use crate::API_VERSION;
use std::collections::BTreeMap;
use std::sync::Arc;

/// How a registry entry makes its backend.
#[derive(Clone, Copy)]
pub enum Factory {
    /// A backend of its own. Must be cheap (no device work until `availability` or `load`).
    Backend(fn() -> Box<dyn Backend>),
    /// Another registered backend bound to one of its devices: `iree-cpu` is `iree` on `cpu`.
    Alias { backend: &'static str, device: &'static str },
}

/// One backend's entry in the registry. Create it with [`crate::register_backend!`] or
/// [`crate::register_backend_alias!`].
pub struct BackendRegistration {
    /// The contract version the backend was compiled against (see [`crate::API_VERSION`]).
    pub api_version: u32,
    /// [`crate::ONE_SESSION_API_PER_BINARY`] of the copy of session-api the entry was made with:
    /// referring to it pulls that copy's symbol into the link, so that two copies collide there.
    pub one_copy: &'static u8,
    /// The registry name.
    pub name: &'static str,
    /// How the backend is made.
    pub factory: Factory,
}

inventory::collect!(BackendRegistration);

/// Registers a backend: `register_backend!("reference", || Box::new(ReferenceBackend::default()));`
#[macro_export]
macro_rules! register_backend {
    ($name:expr, $constructor:expr) => {
        $crate::inventory::submit! {
            $crate::registry::BackendRegistration {
                api_version: $crate::API_VERSION,
                one_copy: &$crate::ONE_SESSION_API_PER_BINARY,
                name: $name,
                factory: $crate::registry::Factory::Backend($constructor),
            }
        }
    };
}

/// Registers a name for a backend on one device: `register_backend_alias!("iree-cpu", "iree", "cpu");`
#[macro_export]
macro_rules! register_backend_alias {
    ($name:expr, $backend:expr, $device:expr) => {
        $crate::inventory::submit! {
            $crate::registry::BackendRegistration {
                api_version: $crate::API_VERSION,
                one_copy: &$crate::ONE_SESSION_API_PER_BINARY,
                name: $name,
                factory: $crate::registry::Factory::Alias { backend: $backend, device: $device },
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
    factory: Factory,
}

impl RegisteredBackend {
    /// Whether it was built against this contract version: true for every entry made with
    /// [`crate::register_backend!`] (a binary has one copy of the contract, see
    /// [`crate::API_VERSION`]); false only for an entry built by hand with another version.
    pub fn is_compatible(&self) -> bool {
        self.api_version == API_VERSION
    }

    /// For an alias, the backend and device it names.
    pub fn alias_of(&self) -> Option<(&'static str, &'static str)> {
        match self.factory {
            Factory::Alias { backend, device } => Some((backend, device)),
            Factory::Backend(_) => None,
        }
    }

    /// Instantiates the backend, refusing an entry stamped with another contract version.
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
        match self.factory {
            Factory::Backend(constructor) => Ok(constructor()),
            Factory::Alias { backend, device } => {
                let target = registered_backends().into_iter().find(|b| b.name == backend && b.alias_of().is_none());
                let target = target.ok_or_else(|| SeamError::Unavailable {
                    backend: self.name.to_string(),
                    reason: format!("it names backend {backend}, which is not in this binary"),
                })?;
                Ok(Box::new(DeviceAlias::new(self.name, target.instantiate()?, device)))
            }
        }
    }
}

/// Every registered backend, sorted by name. Duplicate names keep the first registration.
pub fn registered_backends() -> Vec<RegisteredBackend> {
    // The reader's copy takes part in the link too, even in a binary that registers nothing
    // through it (so a backend registered through another copy cannot be missed quietly).
    // SAFETY: a plain read of an initialized, immutable static.
    let _ = unsafe { std::ptr::read_volatile(&crate::ONE_SESSION_API_PER_BINARY) };
    let mut all: Vec<RegisteredBackend> = inventory::iter::<BackendRegistration>
        .into_iter()
        .map(|r| RegisteredBackend { name: r.name, api_version: r.api_version, factory: r.factory })
        .collect();
    all.sort_by(|a, b| a.name.cmp(b.name));
    all.dedup_by(|a, b| a.name == b.name);
    all
}

/// The backend registered under `name` (an alias gives its backend bound to the alias's device).
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

/// [`find_backend`], configured by `settings` ([`Backend::configure`]) when there are any.
pub fn find_backend_with(name: &str, settings: &BTreeMap<String, String>) -> Result<Box<dyn Backend>> {
    let backend = find_backend(name)?;
    if settings.is_empty() {
        Ok(backend)
    } else {
        backend.configure(settings)
    }
}

/// A backend bound to one of its devices, under a name of its own.
struct DeviceAlias {
    name: &'static str,
    description: String,
    inner: Box<dyn Backend>,
    device: &'static str,
}

impl DeviceAlias {
    fn new(name: &'static str, inner: Box<dyn Backend>, device: &'static str) -> DeviceAlias {
        let description = format!("{} on device {device} ({})", inner.name(), inner.description());
        DeviceAlias { name, description, inner, device }
    }
}

impl Backend for DeviceAlias {
    fn name(&self) -> &str {
        self.name
    }
    fn description(&self) -> &str {
        &self.description
    }
    fn availability(&self) -> Availability {
        self.inner.device_availability(self.device)
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn load(&self, request: &LoadRequest) -> Result<Arc<dyn Engine>> {
        match request.device.as_deref() {
            Some(other) if other != self.device => Err(SeamError::InvalidInput(format!(
                "{} runs on device {} only; use backend {} for device {other}",
                self.name,
                self.device,
                self.inner.name()
            ))),
            _ => {
                let mut request = request.clone();
                request.device = Some(self.device.to_string());
                self.inner.load(&request)
            }
        }
    }
    fn device_availability(&self, id: &str) -> Availability {
        if id == self.device {
            self.inner.device_availability(id)
        } else {
            Availability::Unavailable { reason: format!("{} runs on device {} only", self.name, self.device) }
        }
    }
    fn configure(&self, settings: &BTreeMap<String, String>) -> Result<Box<dyn Backend>> {
        Ok(Box::new(DeviceAlias::new(self.name, self.inner.configure(settings)?, self.device)))
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
        BackendRegistration {
            api_version: API_VERSION + 1,
            one_copy: &crate::ONE_SESSION_API_PER_BINARY,
            name: "test-future",
            factory: Factory::Backend(|| Box::new(Dummy)),
        }
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

    crate::register_backend_alias!("test-dummy-cpu", "test-dummy", "cpu");

    #[test]
    fn an_alias_is_its_backend_on_one_device() {
        let entry = registered_backends().into_iter().find(|b| b.name == "test-dummy-cpu").unwrap();
        assert_eq!(entry.alias_of(), Some(("test-dummy", "cpu")));
        let alias = entry.instantiate().unwrap();
        assert_eq!(alias.name(), "test-dummy-cpu");
        // The target is unavailable, and the alias says why.
        let Availability::Unavailable { reason } = alias.availability() else { panic!("available") };
        assert!(reason.contains("test double"), "{reason}");
        let mut request = LoadRequest::new("/nowhere", crate::WeightFormat::F16);
        request.device = Some("cuda:0".into());
        assert_eq!(alias.load(&request).err().unwrap().kind(), crate::ErrorKind::InvalidInput);
    }

    #[test]
    fn a_backend_built_for_another_api_version_is_refused() {
        let entry = registered_backends().into_iter().find(|b| b.name == "test-future").unwrap();
        assert!(!entry.is_compatible());
        assert_eq!(entry.instantiate().err().unwrap().kind(), crate::ErrorKind::Unavailable);
    }
}
