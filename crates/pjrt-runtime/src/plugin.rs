//! Loading a plugin: `dlopen`, `GetPjrtApi`, the version check, `PJRT_Plugin_Initialize`.

use crate::error::{ErrorCode, PjrtError};
use crate::sys;
use crate::{args, Result};
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// A PJRT C API version (`major.minor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ApiVersion {
    pub major: i32,
    pub minor: i32,
}

impl fmt::Display for ApiVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The C API version of the header the bindings were generated from.
pub const HEADER_VERSION: ApiVersion =
    ApiVersion { major: sys::PJRT_API_MAJOR as i32, minor: sys::PJRT_API_MINOR as i32 };

/// A loaded plugin. Loaded once per path for the life of the process: PJRT plugins must be
/// initialized exactly once and are not meant to be unloaded, so [`Plugin::load`] hands out the
/// same `Arc` for the same file.
pub struct Plugin {
    path: PathBuf,
    api: *const sys::PJRT_Api,
    version: ApiVersion,
    attributes: Vec<(String, String)>,
    // Keeps the code behind `api` mapped; never dropped before the process ends in practice (the
    // registry holds every plugin).
    _library: libloading::Library,
}

// SAFETY: the API table is immutable after `GetPjrtApi`, and the C API's functions are callable
// from any thread.
unsafe impl Send for Plugin {}
unsafe impl Sync for Plugin {}

impl fmt::Debug for Plugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plugin").field("path", &self.path).field("version", &self.version).finish()
    }
}

fn registry() -> &'static Mutex<HashMap<PathBuf, Arc<Plugin>>> {
    static PLUGINS: OnceLock<Mutex<HashMap<PathBuf, Arc<Plugin>>>> = OnceLock::new();
    PLUGINS.get_or_init(Default::default)
}

impl Plugin {
    /// Loads the plugin at `path` (or returns the one already loaded from it): checks that its C
    /// API has the major version of seam's bindings, and initializes it.
    ///
    /// A minor version other than the header's is accepted: the C API's argument structs carry
    /// their size, so either side reads only the fields both know; a function missing from an
    /// older plugin's table is reported when it is called ([`PjrtError::MissingFunction`]).
    pub fn load(path: &Path) -> Result<Arc<Plugin>> {
        if !path.is_file() {
            return Err(PjrtError::NotFound { path: path.to_path_buf() });
        }
        let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let mut plugins = registry().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(plugin) = plugins.get(&key) {
            return Ok(Arc::clone(plugin));
        }
        let plugin = Arc::new(Plugin::open(&key)?);
        plugins.insert(key, Arc::clone(&plugin));
        Ok(plugin)
    }

    fn open(path: &Path) -> Result<Plugin> {
        let load_error = |message: String| PjrtError::Load { path: path.to_path_buf(), message };
        // SAFETY: loading a shared library runs its initializers; a PJRT plugin's are benign.
        let library = unsafe { libloading::Library::new(path) }.map_err(|e| load_error(e.to_string()))?;
        // SAFETY: `GetPjrtApi` is the C API's entry point, `const PJRT_Api* GetPjrtApi(void)`.
        let api = unsafe {
            let get: libloading::Symbol<unsafe extern "C" fn() -> *const sys::PJRT_Api> =
                library.get(b"GetPjrtApi\0").map_err(|e| load_error(format!("no GetPjrtApi symbol: {e}")))?;
            get()
        };
        if api.is_null() {
            return Err(load_error("GetPjrtApi returned no API table".into()));
        }
        // SAFETY: non-null, and every version of the table starts with struct_size and the version.
        let table = unsafe { &*api };
        let version =
            ApiVersion { major: table.pjrt_api_version.major_version, minor: table.pjrt_api_version.minor_version };
        if version.major != HEADER_VERSION.major {
            return Err(PjrtError::ApiVersion { path: path.to_path_buf(), plugin: version, header: HEADER_VERSION });
        }
        let mut plugin = Plugin { path: path.to_path_buf(), api, version, attributes: Vec::new(), _library: library };
        let mut init = args!(PJRT_Plugin_Initialize_Args);
        crate::call!(plugin, PJRT_Plugin_Initialize, &mut init)?;
        plugin.attributes = plugin.read_attributes().unwrap_or_default();
        Ok(plugin)
    }

    /// The file the plugin was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The C API version the plugin implements.
    pub fn version(&self) -> ApiVersion {
        self.version
    }

    /// The plugin's attributes (`xla_version`, `stablehlo_current_version`, ...), as text.
    pub fn attributes(&self) -> &[(String, String)] {
        &self.attributes
    }

    /// One attribute by name.
    pub fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    pub(crate) fn api(&self) -> &sys::PJRT_Api {
        // SAFETY: checked non-null at load; the table lives as long as the library.
        unsafe { &*self.api }
    }

    /// The table entry at `offset`, if the plugin's table is long enough to have it and sets it.
    pub(crate) fn function<F: Copy>(
        &self,
        offset: usize,
        read: impl FnOnce(&sys::PJRT_Api) -> Option<F>,
        name: &'static str,
    ) -> Result<F> {
        if offset + std::mem::size_of::<F>() > self.api().struct_size {
            return Err(PjrtError::MissingFunction(name));
        }
        read(self.api()).ok_or(PjrtError::MissingFunction(name))
    }

    /// `Ok` for a null error; otherwise the error's code and message, and the error freed.
    pub(crate) fn check(&self, error: *mut sys::PJRT_Error, function: &'static str) -> Result<()> {
        if error.is_null() {
            return Ok(());
        }
        let api = self.api();
        let mut message_args = args!(PJRT_Error_Message_Args { error: error });
        let message = match api.PJRT_Error_Message {
            Some(f) => {
                // SAFETY: `error` is a live error of this plugin; the message lives as long as it.
                unsafe { f(&mut message_args) };
                if message_args.message.is_null() {
                    String::new()
                } else {
                    // SAFETY: the plugin returned `message_size` bytes at `message`.
                    let bytes = unsafe {
                        std::slice::from_raw_parts(message_args.message as *const u8, message_args.message_size)
                    };
                    String::from_utf8_lossy(bytes).into_owned()
                }
            }
            None => "(the plugin gives no error message)".into(),
        };
        let mut code_args = args!(PJRT_Error_GetCode_Args { error: error });
        let code = match api.PJRT_Error_GetCode {
            // SAFETY: as above.
            Some(f) if unsafe { f(&mut code_args) }.is_null() => ErrorCode::from_sys(code_args.code),
            _ => ErrorCode::Unknown,
        };
        if let Some(destroy) = api.PJRT_Error_Destroy {
            let mut destroy_args = args!(PJRT_Error_Destroy_Args { error: error });
            // SAFETY: frees the error exactly once; nothing refers to it afterwards.
            unsafe { destroy(&mut destroy_args) };
        }
        Err(PjrtError::Call { function, code, message })
    }

    /// Waits for `event` (if any), frees it, and returns its error status.
    pub(crate) fn await_event(&self, event: *mut sys::PJRT_Event) -> Result<()> {
        if event.is_null() {
            return Ok(());
        }
        let mut wait = args!(PJRT_Event_Await_Args { event: event });
        let status = crate::call!(self, PJRT_Event_Await, &mut wait);
        let mut destroy = args!(PJRT_Event_Destroy_Args { event: event });
        let freed = crate::call!(self, PJRT_Event_Destroy, &mut destroy);
        status.and(freed)
    }

    fn read_attributes(&self) -> Result<Vec<(String, String)>> {
        let mut a = args!(PJRT_Plugin_Attributes_Args);
        crate::call!(self, PJRT_Plugin_Attributes, &mut a)?;
        if a.attributes.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: the plugin returned `num_attributes` values that live as long as the process.
        let values = unsafe { std::slice::from_raw_parts(a.attributes, a.num_attributes) };
        Ok(values.iter().map(named_value_text).collect())
    }
}

/// A named value as `(name, text)`.
fn named_value_text(value: &sys::PJRT_NamedValue) -> (String, String) {
    // SAFETY (all reads below): the plugin filled `name`/`name_size` and the union member its
    // `type_` says, with `value_size` elements for arrays and strings.
    let text = |ptr: *const std::os::raw::c_char, len: usize| unsafe {
        String::from_utf8_lossy(std::slice::from_raw_parts(ptr as *const u8, len)).into_owned()
    };
    let name = if value.name.is_null() { String::new() } else { text(value.name, value.name_size) };
    let union = &value.__bindgen_anon_1;
    let shown = match value.type_ {
        sys::PJRT_NamedValue_Type_PJRT_NamedValue_kString => unsafe { text(union.string_value, value.value_size) },
        sys::PJRT_NamedValue_Type_PJRT_NamedValue_kInt64 => unsafe { union.int64_value.to_string() },
        sys::PJRT_NamedValue_Type_PJRT_NamedValue_kInt64List => unsafe {
            let items = std::slice::from_raw_parts(union.int64_array_value, value.value_size);
            items.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(".")
        },
        sys::PJRT_NamedValue_Type_PJRT_NamedValue_kFloat => unsafe { union.float_value.to_string() },
        sys::PJRT_NamedValue_Type_PJRT_NamedValue_kBool => unsafe { union.bool_value.to_string() },
        _ => "?".to_string(),
    };
    (name, shown)
}
