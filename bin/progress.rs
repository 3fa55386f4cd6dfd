//! Progress of long work for people: an `indicatif` bar redrawn in place when stderr is a
//! terminal, and plain lines on stdout otherwise (at most one per twentieth of the work,
//! plus the first and the last), so that CI logs and files stay readable.
//!
//! Only the binary draws bars; the library reports progress through callbacks and events.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use parking_lot::Mutex;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One piece of long work, `len` units long.
pub struct Bar {
    bar: Option<ProgressBar>,
    label: String,
    len: u64,
    /// Plain lines say megabytes.
    in_bytes: bool,
    /// Plain lines go to stderr (stdout carries JSON).
    plain_stderr: bool,
    /// Plain mode: the next position that prints a line, and the time after which any
    /// update prints one (for work whose length is unknown or slow to move).
    next_pos: AtomicU64,
    next_time: Mutex<Instant>,
    every: u64,
    /// Plain mode: the line at the end was printed.
    ended: AtomicBool,
}

/// Plain mode prints at least this often while work moves.
const PLAIN_EVERY: Duration = Duration::from_secs(30);

impl Bar {
    /// A bar of `len` counted units (steps, samples), labelled `label`.
    pub fn new(len: u64, label: &str) -> Self {
        Self::styled(
            len,
            label,
            "{prefix} [{bar:24}] {pos}/{len} {msg} (eta {eta})",
        )
    }

    /// A bar of `len` bytes.
    pub fn bytes(len: u64, label: &str) -> Self {
        Self::styled(
            len,
            label,
            "{prefix} [{bar:24}] {bytes}/{total_bytes} {bytes_per_sec} {msg} (eta {eta})",
        )
    }

    /// A spinner saying `msg`, for work of unknown length (nothing in plain mode).
    pub fn spinner(label: &str, msg: &str) -> Self {
        let b = Self::styled(0, label, "{prefix} {spinner} {msg} ({elapsed})");
        if let Some(bar) = &b.bar {
            bar.set_message(msg.to_string());
            bar.enable_steady_tick(Duration::from_millis(120));
        }
        b
    }

    fn styled(len: u64, label: &str, template: &str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let style = ProgressStyle::with_template(template)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("#>.");
            let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
            bar.set_style(style);
            bar.set_prefix(label.to_string());
            bar
        });
        Self {
            bar,
            label: label.to_string(),
            len,
            in_bytes: template.contains("{bytes}"),
            plain_stderr: false,
            next_pos: AtomicU64::new(0),
            next_time: Mutex::new(Instant::now() + PLAIN_EVERY),
            every: (len / 20).max(1),
            ended: AtomicBool::new(false),
        }
    }

    /// Plain lines go to stderr, for processes whose stdout is a JSON stream.
    pub fn plain_on_stderr(mut self) -> Self {
        self.plain_stderr = true;
        self
    }

    /// Moves to `pos`; `msg` makes the message drawn beside the bar, or the plain line's
    /// tail (`LABEL POS/LEN  MSG`, printed when `pos` crossed the next twentieth, is the
    /// last, or time has passed).
    pub fn set(&self, pos: u64, msg: impl FnOnce() -> String) {
        match &self.bar {
            Some(bar) => {
                bar.set_position(pos);
                bar.set_message(msg());
            }
            None => {
                if self.plain_due(pos, Instant::now()) {
                    let line = if self.in_bytes {
                        let mb = |b: u64| b as f64 / 1e6;
                        format!(
                            "{} {:.1}/{:.1} MB  {}",
                            self.label,
                            mb(pos),
                            mb(self.len),
                            msg()
                        )
                    } else if self.len > 0 {
                        format!("{} {pos:>6}/{}  {}", self.label, self.len, msg())
                    } else {
                        format!("{} {pos}  {}", self.label, msg())
                    };
                    if self.plain_stderr {
                        eprintln!("{}", line.trim_end());
                    } else {
                        println!("{}", line.trim_end());
                    }
                }
            }
        }
    }

    /// Plain mode: whether a line is due at `pos` (the first call, each twentieth, the end
    /// once, or [`PLAIN_EVERY`] since the last line); a line due is counted as printed.
    fn plain_due(&self, pos: u64, now: Instant) -> bool {
        let last = pos >= self.len && self.len > 0;
        let due_pos = pos >= self.next_pos.load(Ordering::Relaxed)
            || (last && !self.ended.swap(true, Ordering::Relaxed));
        let mut t = self.next_time.lock();
        let due = due_pos || now >= *t;
        if due {
            *t = now + PLAIN_EVERY;
            let next = (pos / self.every + 1) * self.every;
            self.next_pos.fetch_max(next, Ordering::Relaxed);
            if last {
                self.ended.store(true, Ordering::Relaxed);
            }
        }
        due
    }

    /// Prints `text` on stdout without tearing the bar.
    pub fn println(&self, text: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| println!("{text}")),
            None => println!("{text}"),
        }
    }

    /// Leaves the bar where it is, finished.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }

    /// Removes the bar (work whose result is printed after it).
    pub fn clear(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// A training loss for a progress line: `-` until some sample completed (a zero there
/// would read as a perfect model).
pub fn loss_text(completed: u64, loss: f64) -> String {
    if completed == 0 || !loss.is_finite() {
        "-".into()
    } else {
        format!("{loss:.4}")
    }
}

/// The bar of the state download under way, one stage at a time (a peer's `downloading`
/// events, `shoal export`'s stages): a new stage's download replaces the bar.
#[derive(Default)]
pub struct DownloadBar {
    current: Option<(usize, Bar)>,
    plain_stderr: bool,
}

impl DownloadBar {
    /// Plain lines go to stderr, for processes whose stdout is a JSON stream.
    pub fn plain_on_stderr() -> Self {
        Self {
            current: None,
            plain_stderr: true,
        }
    }

    /// Shows `bytes` of `total` downloaded for `stage`. A stage whose bar is not shown
    /// gets one only while its download is unfinished.
    pub fn show(&mut self, stage: usize, bytes: u64, total: u64) {
        let shown = self.current.as_ref().is_some_and(|(s, _)| *s == stage);
        if !shown && bytes < total {
            let b = Bar::bytes(total, &format!("stage {stage} state"));
            let b = if self.plain_stderr {
                b.plain_on_stderr()
            } else {
                b
            };
            self.current = Some((stage, b));
        }
        if let Some((s, b)) = &self.current {
            if *s == stage {
                b.set(bytes, String::new);
            }
        }
    }

    /// Removes the bar, if one is shown.
    pub fn clear(&mut self) {
        if let Some((_, b)) = self.current.take() {
            b.clear();
        }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            if !bar.is_finished() {
                bar.abandon();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_loss_is_shown_before_a_sample_completed() {
        assert_eq!(loss_text(0, 0.0), "-");
        assert_eq!(loss_text(5, f64::NAN), "-");
        assert_eq!(loss_text(16, 1.23456), "1.2346");
    }

    #[test]
    fn plain_lines_come_at_each_twentieth_and_once_at_the_end() {
        // Tests do not run on a terminal: this is the plain mode.
        let bar = Bar::new(98, "step");
        assert!(bar.bar.is_none());
        let t = Instant::now();
        let due: Vec<u64> = (0..=98)
            .chain([98, 98])
            .filter(|&p| bar.plain_due(p, t))
            .collect();
        let mut want: Vec<u64> = (0..=96).step_by(4).collect();
        want.push(98);
        assert_eq!(due, want);
        // Work that stalls still prints, every PLAIN_EVERY.
        assert!(!bar.plain_due(98, t + Duration::from_secs(1)));
        assert!(bar.plain_due(50, t + PLAIN_EVERY + Duration::from_secs(1)));
    }

    #[test]
    fn a_download_bar_follows_the_stage_and_a_finished_download_starts_none() {
        let stage = |d: &DownloadBar| d.current.as_ref().map(|(s, _)| *s);
        let mut d = DownloadBar::plain_on_stderr();
        d.show(1, 0, 100);
        assert_eq!(stage(&d), Some(1));
        d.show(1, 100, 100);
        assert_eq!(stage(&d), Some(1));
        d.clear();
        assert_eq!(stage(&d), None);
        d.show(1, 100, 100);
        assert_eq!(stage(&d), None);
        d.show(2, 10, 100);
        assert_eq!(stage(&d), Some(2));
    }
}
