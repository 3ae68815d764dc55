//! Progress bars on stderr for work that takes more than a moment (loading, converting).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use session_api::backend::ProgressFn;
use session_api::LoadProgress;
use std::sync::{Arc, Mutex};

/// A bar that follows [`LoadProgress`] reports, restarting its message when the stage changes.
/// Draws only when stderr is a terminal, so logs and pipes stay clean.
pub struct StageBar {
    bar: ProgressBar,
}

impl StageBar {
    /// A hidden-until-used bar.
    pub fn new() -> Self {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template("{spinner} {msg:<28} [{bar:30}] {pos}/{len} ({elapsed})")
                .expect("the template is valid")
                .progress_chars("=> "),
        );
        StageBar { bar }
    }

    /// Applies one report.
    pub fn update(&self, progress: &LoadProgress) {
        if self.bar.message() != progress.stage {
            self.bar.set_message(progress.stage.clone());
        }
        if let Some(total) = progress.total {
            self.bar.set_length(total);
        }
        self.bar.set_position(progress.done);
    }

    /// Applies a `(done, total)` report of a single-stage job (conversion, installation).
    pub fn count(&self, stage: &str, done: u64, total: u64) {
        self.update(&LoadProgress { stage: stage.to_string(), done, total: Some(total) });
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }

    /// A callback for `LoadRequest::progress` feeding this bar.
    pub fn callback(self: &Arc<Self>) -> ProgressFn {
        let bar = Arc::clone(self);
        let last = Mutex::new(());
        Arc::new(move |p: LoadProgress| {
            let _serialize = last.lock();
            bar.update(&p);
        })
    }
}
