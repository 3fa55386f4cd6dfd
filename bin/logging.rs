//! Logging of the binary: the `tracing` subscriber every command installs (stderr, text or
//! JSON lines, filtered by `RUST_LOG` or -v/-q).

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
