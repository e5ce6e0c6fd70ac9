//! Progress of the long-running commands (the soak, the benchmarks' phases, replaying events,
//! migrations) on a terminal; nothing at all when stderr is not one (a log file, CI), where the
//! commands' own lines say what happened.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

fn target() -> ProgressDrawTarget {
    if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}

fn styled(bar: ProgressBar, template: &str) -> ProgressBar {
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar
}

/// A spinner saying `message`, with the time spent, until finished or dropped.
pub fn spinner(message: impl Into<String>) -> ProgressBar {
    let bar = styled(
        ProgressBar::with_draw_target(None, target()),
        "{spinner} {msg} ({elapsed})",
    );
    bar.set_message(message.into());
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// A bar of `len` steps saying `message`.
pub fn bar(len: u64, message: impl Into<String>) -> ProgressBar {
    let bar = styled(
        ProgressBar::with_draw_target(Some(len), target()),
        "{msg} [{bar:30}] {pos}/{len} ({elapsed}, about {eta} left)",
    );
    bar.set_message(message.into());
    bar.enable_steady_tick(Duration::from_millis(250));
    bar
}
