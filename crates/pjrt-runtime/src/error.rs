//! Errors: the plugin's own (a `PJRT_Error` with a status code and a message) and seam's checks.

use std::path::PathBuf;

/// A PJRT status code (abseil's), as the plugin reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    Cancelled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl ErrorCode {
    pub(crate) fn from_sys(code: crate::sys::PJRT_Error_Code) -> ErrorCode {
        use crate::sys::PJRT_Error_Code as C;
        match code {
            C::PJRT_Error_Code_CANCELLED => ErrorCode::Cancelled,
            C::PJRT_Error_Code_INVALID_ARGUMENT => ErrorCode::InvalidArgument,
            C::PJRT_Error_Code_DEADLINE_EXCEEDED => ErrorCode::DeadlineExceeded,
            C::PJRT_Error_Code_NOT_FOUND => ErrorCode::NotFound,
            C::PJRT_Error_Code_ALREADY_EXISTS => ErrorCode::AlreadyExists,
            C::PJRT_Error_Code_PERMISSION_DENIED => ErrorCode::PermissionDenied,
            C::PJRT_Error_Code_RESOURCE_EXHAUSTED => ErrorCode::ResourceExhausted,
            C::PJRT_Error_Code_FAILED_PRECONDITION => ErrorCode::FailedPrecondition,
            C::PJRT_Error_Code_ABORTED => ErrorCode::Aborted,
            C::PJRT_Error_Code_OUT_OF_RANGE => ErrorCode::OutOfRange,
            C::PJRT_Error_Code_UNIMPLEMENTED => ErrorCode::Unimplemented,
            C::PJRT_Error_Code_INTERNAL => ErrorCode::Internal,
            C::PJRT_Error_Code_UNAVAILABLE => ErrorCode::Unavailable,
            C::PJRT_Error_Code_DATA_LOSS => ErrorCode::DataLoss,
            C::PJRT_Error_Code_UNAUTHENTICATED => ErrorCode::Unauthenticated,
            // OK never comes with an error object; treat anything else as unknown.
            _ => ErrorCode::Unknown,
        }
    }
}

/// What can go wrong between a plugin file and a finished execution.
#[derive(Debug, thiserror::Error)]
pub enum PjrtError {
    /// No file at the plugin path.
    #[error("no PJRT plugin at {}", path.display())]
    NotFound { path: PathBuf },
    /// The file exists but is not a loadable plugin (`dlopen` failed, or no `GetPjrtApi`).
    #[error("{} could not be loaded as a PJRT plugin: {message}", path.display())]
    Load { path: PathBuf, message: String },
    /// The plugin implements another major version of the C API than seam's bindings.
    #[error("{} implements PJRT C API {plugin}, seam is built against {header} (the major versions differ)", path.display())]
    ApiVersion { path: PathBuf, plugin: crate::ApiVersion, header: crate::ApiVersion },
    /// The plugin's API table is too old to have this function.
    #[error("the PJRT plugin does not provide {0} (its C API is older than the function)")]
    MissingFunction(&'static str),
    /// A C API call returned an error.
    #[error("{function}: {message} ({code:?})")]
    Call { function: &'static str, code: ErrorCode, message: String },
    /// The client has no addressable device.
    #[error("the PJRT plugin found no device")]
    NoDevice,
    /// A call was asked for something inconsistent (wrong byte count for a shape, ...).
    #[error("{0}")]
    InvalidArgument(String),
}

impl PjrtError {
    /// The plugin's status code, when the error came from the plugin.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            PjrtError::Call { code, .. } => Some(*code),
            _ => None,
        }
    }
}
