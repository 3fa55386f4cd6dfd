//! `shoal export` (stage checkpoints, or a live swarm → one model file) and
//! `shoal generate` (sample a continuation from it).

use crate::args::{client_config, require_bootstrap, NetArgs};
use crate::peer_cmd::runtime;
use crate::progress::DownloadBar;
use anyhow::{bail, Result};
use clap::Args;
use shoal::data::tokenizer::Tok;
use shoal::model::export;
use shoal::model::generate::{self, Sampling};
use shoal::net;
use shoal::swarm::peer::RunSource;
use std::cell::RefCell;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct ExportArgs {
    /// Stage checkpoints of one run, one per stage (from `shoal peer --checkpoint`).
    #[arg(long, value_name = "FILE", num_args = 1.., required_unless_present = "run", conflicts_with = "run")]
    pub checkpoints: Vec<PathBuf>,
    /// Export from a live swarm instead: the run id (or its manifest file); needs
    /// --bootstrap. Every stage's current state is downloaded from its replicas.
    #[arg(long, value_name = "ID|FILE")]
    pub run: Option<String>,
    #[command(flatten)]
    pub net: NetArgs,
    /// The model file to write (safetensors, the config in its metadata).
    #[arg(long, value_name = "FILE", default_value = "model.safetensors")]
    pub out: PathBuf,
}

#[derive(Args)]
pub struct GenerateArgs {
    /// A model written by `shoal export`.
    #[arg(long, value_name = "FILE")]
    pub model: PathBuf,
    /// The run's tokenizer.json.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: PathBuf,
    /// The text to continue.
    #[arg(long, value_name = "TEXT")]
    pub prompt: String,
    /// Tokens to generate, at most.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub tokens: usize,
    /// Softmax temperature (0: always the most likely token).
    #[arg(long, default_value_t = 0.8, value_name = "T")]
    pub temperature: f64,
    /// Nucleus sampling: keep the most likely tokens up to this probability.
    #[arg(long, default_value_t = 0.95, value_name = "P")]
    pub top_p: f64,
    /// Seed (the same seed gives the same text).
    #[arg(long, default_value_t = 1, value_name = "S")]
    pub seed: u64,
    /// Device: cpu, cuda:N or metal.
    #[arg(long, default_value = "cpu", value_name = "DEVICE")]
    pub device: String,
}

pub fn export(a: ExportArgs) -> Result<ExitCode> {
    let e = match &a.run {
        None => export::from_checkpoints(&a.checkpoints, &a.out)?,
        Some(run) => from_swarm(&a, run)?,
    };
    println!(
        "wrote {}: run {}, {} tensors, {:.2}M parameters, stage steps {:?}",
        a.out.display(),
        e.run,
        e.tensors,
        e.params as f64 / 1e6,
        e.steps
    );
    Ok(ExitCode::SUCCESS)
}

/// `shoal export --run`: every stage's state from the live swarm.
fn from_swarm(a: &ExportArgs, run: &str) -> Result<export::Exported> {
    require_bootstrap(&a.net)?;
    let source = RunSource::parse(run);
    let (cfg, bootstrap) = client_config(&a.net)?;
    let out = a.out.clone();
    runtime()?.block_on(async move {
        let handle = net::start(cfg)?;
        shoal::swarm::peer::join(&handle, &bootstrap).await?;
        let m = crate::client_cmds::manifest_of(&handle, source).await?;
        let fetched = shoal::averaging::sync::Fetched::default();
        let bar = RefCell::new(DownloadBar::default());
        let work = shoal::swarm::export::from_swarm(&handle, &m, &out, &fetched, |s, step, mb| {
            bar.borrow_mut().clear();
            eprintln!("stage {s}: step {step}, {mb:.1} MB of state downloaded");
        });
        tokio::pin!(work);
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(250));
        let e = loop {
            tokio::select! {
                r = &mut work => break r,
                _ = tick.tick() => {
                    let (s, bytes, total) = fetched.read();
                    bar.borrow_mut().show(s, bytes, total);
                }
            }
        };
        bar.borrow_mut().clear();
        handle.shutdown().await;
        Ok(e?)
    })
}

pub fn generate(a: GenerateArgs) -> Result<ExitCode> {
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        bail!("--temperature must be 0 or more");
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1]");
    }
    let device = shoal::model::parse_device(&a.device).map_err(anyhow::Error::msg)?;
    let tok = Tok::load(&a.tokenizer)?;
    let (cfg, model) = export::load_model(&a.model, &device)?;
    if tok.vocab() > cfg.model.vocab {
        bail!(
            "the tokenizer has {} tokens but the model only {}: use the tokenizer the run was trained with",
            tok.vocab(),
            cfg.model.vocab
        );
    }
    let prompt = tok.encode(&a.prompt)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens: give some text");
    }
    let s = Sampling {
        tokens: a.tokens,
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed,
        stop: tok.end_of_text(),
    };
    let g = generate::generate(&model, &prompt, &s)?;
    println!("{}{}", a.prompt, tok.decode(&g.tokens)?);
    eprintln!(
        "{} tokens in {:.2} s, {:.1} tokens/s ({} prompt tokens, KV cache)",
        g.tokens.len(),
        g.seconds,
        g.tokens_per_s(),
        prompt.len()
    );
    Ok(ExitCode::SUCCESS)
}
