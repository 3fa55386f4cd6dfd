//! Logging of the binary: the `tracing` subscriber every command installs (stderr, text or
//! JSON lines, filtered by `RUST_LOG` or -v/-q), and which panics are printed.

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Installs the `tracing` subscriber: logs go to stderr, filtered by `RUST_LOG` when set,
/// else by -v/-q (shoal's own targets one level more verbose than the libraries', whose
/// warnings, like a DHT with no peers yet, would break one-line errors by default).
pub fn init(quiet: bool, verbose: u8, format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = match std::env::var("RUST_LOG") {
        Ok(f) if !f.is_empty() => EnvFilter::new(f),
        _ => EnvFilter::new(match (quiet, verbose) {
            (true, _) => "error",
            (false, 0) => "error,shoal=warn",
            (false, 1) => "warn,shoal=info",
            (false, 2) => "info,shoal=debug",
            _ => "debug,shoal=trace",
        }),
    };
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(true);
    let _ = match format {
        LogFormat::Text => fmt.try_init(),
        LogFormat::Json => fmt.json().try_init(),
    };
}

/// `shoal ... | head` closes stdout early: `println!` then panics. Exit as a Unix tool
/// killed by SIGPIPE would (status 141), without a backtrace. A stage compute thread's
/// panic is caught and reported by its peer in one line; other panics are unchanged.
pub fn quiet_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        // A stage's compute thread catches its own panics: the peer withdraws the replica
        // and exits with one line saying why, so the panic is not printed here too.
        let compute = std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("shoal-stage-"));
        if !compute {
            default(info);
        }
    }));
}
