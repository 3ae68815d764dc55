//! A case's verdict while it runs, and the conversions that turn a backend's error into one.

use crate::report::{Figures, Outcome};
use session_api::{ErrorKind, SeamError};

/// The verdict of one case, before the runner adds its name, model and timing.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// Pass, fail, unsupported or unavailable.
    pub outcome: Outcome,
    /// Why, in a sentence.
    pub detail: String,
    /// What was measured.
    pub figures: Figures,
}

impl Verdict {
    /// A pass, with what was checked.
    pub fn pass(detail: impl Into<String>) -> Verdict {
        Verdict { outcome: Outcome::Pass, detail: detail.into(), figures: Figures::default() }
    }

    /// A failure, with what went wrong.
    pub fn fail(detail: impl Into<String>) -> Verdict {
        Verdict { outcome: Outcome::Fail, detail: detail.into(), figures: Figures::default() }
    }

    /// The backend lacks a capability the case needs.
    pub fn unsupported(detail: impl Into<String>) -> Verdict {
        Verdict { outcome: Outcome::Unsupported, detail: detail.into(), figures: Figures::default() }
    }

    /// The case cannot run here.
    pub fn unavailable(detail: impl Into<String>) -> Verdict {
        Verdict { outcome: Outcome::Unavailable, detail: detail.into(), figures: Figures::default() }
    }

    /// The same verdict carrying `figures`.
    pub fn with_figures(mut self, figures: Figures) -> Verdict {
        self.figures = figures;
        self
    }
}

/// A case step's result: `Err` ends the case early with that verdict (usually a failure).
pub type Checked<T> = Result<T, Verdict>;

/// The verdict for a backend call that failed where the case expected success. Cases only call
/// what the backend claims, so `Unsupported` here is a claimed capability refused: a failure too.
pub fn call_failed(what: &str, error: &SeamError) -> Verdict {
    if error.kind() == ErrorKind::Unsupported {
        Verdict::fail(format!("{what}: refused as unsupported although the backend claims the capability ({error})"))
    } else {
        Verdict::fail(format!("{what} failed: {error}"))
    }
}

/// Adds [`call_failed`] to backend results.
pub trait OrFail<T> {
    /// Turns an error into a failing verdict naming `what` was attempted.
    fn or_fail(self, what: impl FnOnce() -> String) -> Checked<T>;
}

impl<T> OrFail<T> for session_api::Result<T> {
    fn or_fail(self, what: impl FnOnce() -> String) -> Checked<T> {
        self.map_err(|e| call_failed(&what(), &e))
    }
}

/// Checks that `result` is an error of `kind`; `what` names the call for the message.
pub fn expect_error<T>(result: session_api::Result<T>, kind: ErrorKind, what: &str) -> Checked<SeamError> {
    match result {
        Ok(_) => Err(Verdict::fail(format!("{what} succeeded; the contract requires a {kind:?} error"))),
        Err(e) if e.kind() == kind => Ok(e),
        Err(e) => {
            Err(Verdict::fail(format!("{what} returned a {:?} error ({e}); the contract requires {kind:?}", e.kind())))
        }
    }
}
