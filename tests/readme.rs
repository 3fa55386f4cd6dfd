//! README.md's command blocks, run as written: a README edit that breaks a walkthrough, or
//! names a flag that does not exist, fails here.
//!
//! A walkthrough block runs line by line with `bash` in a fresh folder, `shoal` on the
//! PATH being the binary under test. The only changes to the text are the placeholders
//! a reader fills in: RUN_ID (what `shoal run new` printed), PEER_ID and ADDR (the first
//! peer's printed address), and the port 4001 (a free one, as tests run side by side).
//! `cargo build` lines are skipped (cargo built the binary), `shoal peer` lines run in the
//! background until they print `ready`, a comment saying "Ctrl-C" stops those peers with
//! SIGINT and waits for them, and every other line must exit 0. The folder holds what a
//! reader brings: the repository's configs (training steps cut short) and a corpus.txt.
//! The Commands block's synopses are checked against each command's `--help`, the toml
//! snippets against the config loader, and the quick start's demo runs in
//! `tests/cli_peer.rs` (with one replica per stage, to keep CI short).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_shoal");

fn readme() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap()
}

/// The ```sh block under the heading `heading`, its lines with continuations joined.
fn block(text: &str, heading: &str) -> Vec<String> {
    let start = text
        .find(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("README has no section {heading:?}"));
    let rest = &text[start..];
    let open = rest.find("```sh\n").expect("a ```sh block") + 6;
    let close = rest[open..].find("```").expect("a closed block") + open;
    let mut lines = Vec::new();
    let mut cur = String::new();
    for l in rest[open..close].lines() {
        let l = l.trim_end();
        match l.strip_suffix('\\') {
            Some(head) => cur.push_str(head),
            None => {
                cur.push_str(l);
                lines.push(std::mem::take(&mut cur));
            }
        }
    }
    lines
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Replaces whole-word `word` with `with`.
fn replace_word(line: &str, word: &str, with: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(i) = rest.find(word) {
        let before = rest[..i].chars().last();
        let after = rest[i + word.len()..].chars().next();
        let is_word = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        out.push_str(&rest[..i]);
        out.push_str(if is_word(before) || is_word(after) {
            word
        } else {
            with
        });
        rest = &rest[i + word.len()..];
    }
    out.push_str(rest);
    out
}

struct Walk {
    dir: tempfile::TempDir,
    path: String,
    port: u16,
    run_id: Option<String>,
    addr: Option<String>,
    peers: Vec<(String, Child, PathBuf)>,
    transcript: Vec<String>,
}

impl Walk {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        std::os::unix::fs::symlink(BIN, bin.join("shoal")).unwrap();
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        // The repository's configs, training cut short so each walkthrough takes seconds.
        let configs = dir.path().join("configs");
        std::fs::create_dir(&configs).unwrap();
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        for name in ["tiny.toml", "llama-tiny.toml"] {
            let text = std::fs::read_to_string(root.join(name)).unwrap();
            let short: Vec<String> = text
                .lines()
                .map(|l| {
                    if l.starts_with("steps = ") {
                        "steps = 6".to_string()
                    } else if l.starts_with("warmup_steps = ") {
                        "warmup_steps = 2".to_string()
                    } else {
                        l.to_string()
                    }
                })
                .collect();
            std::fs::write(configs.join(name), short.join("\n")).unwrap();
        }
        Self {
            dir,
            path,
            port: free_port(),
            run_id: None,
            addr: None,
            peers: Vec::new(),
            transcript: Vec::new(),
        }
    }

    /// The line with the reader's placeholders filled and the trailing comment dropped.
    fn fill(&self, line: &str) -> String {
        let mut l = match line.find("  #") {
            Some(i) => line[..i].trim_end().to_string(),
            None => line.trim_end().to_string(),
        };
        l = l.replace("tcp/4001", &format!("tcp/{}", self.port));
        if let Some(id) = &self.run_id {
            l = replace_word(&l, "RUN_ID", id);
        }
        if let Some(a) = &self.addr {
            let peer = a.rsplit('/').next().unwrap();
            l = replace_word(&l, "PEER_ID", peer);
            l = replace_word(&l, "ADDR", a);
        }
        l
    }

    fn bash(&self, line: &str) -> Command {
        let mut c = Command::new("bash");
        c.args(["-c", &format!("exec {line}")])
            .current_dir(self.dir.path())
            .env("PATH", &self.path)
            .env("NO_COLOR", "1");
        c
    }

    fn fail(&self, why: String) -> ! {
        let logs: Vec<String> = self
            .peers
            .iter()
            .map(|(l, _, log)| {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(8).collect();
                format!(
                    "[{l}] …{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                )
            })
            .collect();
        panic!("{why}\nran: {:#?}\npeer logs: {logs:#?}", self.transcript);
    }

    /// Runs one README line.
    fn step(&mut self, raw: &str) {
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with("cargo build") {
            return;
        }
        if trimmed.starts_with('#') {
            if trimmed.contains("Ctrl-C") {
                self.stop_peers();
            }
            return;
        }
        let line = self.fill(trimmed);
        for placeholder in ["RUN_ID", "PEER_ID", "ADDR"] {
            if replace_word(&line, placeholder, "") != line {
                self.fail(format!(
                    "{placeholder} is used before anything printed it: {line}"
                ));
            }
        }
        self.transcript.push(line.clone());
        if line.starts_with("shoal peer ") {
            self.start_peer(line);
        } else {
            self.run(&line);
        }
    }

    fn run(&mut self, line: &str) {
        let mut child = self
            .bash(line)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(300);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                self.fail(format!("{line}: still running after 300 s"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        if !out.status.success() {
            self.fail(format!(
                "{line}: exit {:?}: {}{}",
                out.status.code(),
                stdout,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        if line.starts_with("shoal run new") {
            let id = stdout
                .split_whitespace()
                .rfind(|w| w.len() == 32 && w.chars().all(|c| c.is_ascii_hexdigit()))
                .map(str::to_string);
            if id.is_none() {
                self.fail(format!("{line}: printed no run id: {stdout}"));
            }
            self.run_id = id;
        }
    }

    fn start_peer(&mut self, line: String) {
        let log = self
            .dir
            .path()
            .join(format!("peer{}.log", self.peers.len()));
        let out = std::fs::File::create(&log).unwrap();
        let child = self
            .bash(&line)
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        self.peers.push((line.clone(), child, log.clone()));
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.lines().any(|l| l.contains(" ready")) {
                if self.addr.is_none() {
                    let want = format!("/ip4/127.0.0.1/tcp/{}/p2p/", self.port);
                    self.addr = text
                        .split_whitespace()
                        .find(|w| w.starts_with(&want))
                        .map(str::to_string);
                }
                return;
            }
            let exited = self.peers.last_mut().unwrap().1.try_wait().unwrap();
            if exited.is_some() || Instant::now() > deadline {
                self.fail(format!("{line}: never printed ready ({exited:?})"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Ctrl-C to every peer; each must exit 0 (having written its checkpoint).
    fn stop_peers(&mut self) {
        for (_, c, _) in &self.peers {
            Command::new("kill")
                .args(["-INT", &c.id().to_string()])
                .status()
                .unwrap();
        }
        let peers = std::mem::take(&mut self.peers);
        for (line, mut c, log) in peers {
            let deadline = Instant::now() + Duration::from_secs(60);
            let status = loop {
                if let Some(s) = c.try_wait().unwrap() {
                    break s;
                }
                if Instant::now() > deadline {
                    let _ = c.kill();
                    break c.wait().unwrap();
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            if !status.success() {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                self.fail(format!("{line}: Ctrl-C gave {status:?}: {text}"));
            }
        }
    }
}

impl Drop for Walk {
    fn drop(&mut self) {
        for (_, c, _) in &mut self.peers {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Some lines of text for `shoal tokenizer train` and `data prepare`: a reader's corpus.
fn write_corpus(dir: &Path) {
    let words = [
        "the",
        "swarm",
        "trains",
        "one",
        "model",
        "on",
        "many",
        "small",
        "machines",
        "and",
        "every",
        "peer",
        "serves",
        "a",
        "stage",
        "of",
        "it",
        "while",
        "gradients",
        "travel",
        "compressed",
        "over",
        "slow",
        "links",
        "from",
        "home",
        "to",
        "lab",
    ];
    let mut x: u64 = 12345;
    let mut text = String::new();
    for _ in 0..6000 {
        let n = 6 + (x % 9) as usize;
        let mut sentence = Vec::new();
        for _ in 0..n {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            sentence.push(words[(x >> 33) as usize % words.len()]);
        }
        text.push_str("The ");
        text.push_str(&sentence.join(" "));
        text.push_str(".\n");
    }
    std::fs::write(dir.join("corpus.txt"), text).unwrap();
}

#[test]
fn a_swarm_in_three_terminals_runs_as_written() {
    let mut w = Walk::new();
    for line in block(&readme(), "A swarm in three terminals") {
        w.step(&line);
    }
    // The walkthrough ended with `shoal probe --check` passing on the training swarm.
    assert!(w.transcript.last().unwrap().starts_with("shoal probe"));
    assert_eq!(w.peers.len(), 3);
}

#[test]
fn train_your_own_model_runs_as_written() {
    let mut w = Walk::new();
    write_corpus(w.dir.path());
    for line in block(&readme(), "Train your own model") {
        w.step(&line);
    }
    for f in [
        "tok.json",
        "a.ckpt",
        "b.ckpt",
        "model.safetensors",
        "live.safetensors",
    ] {
        assert!(w.dir.path().join(f).is_file(), "{f} was not written");
    }
    // The model exported from the checkpoints is the live swarm's: same step, same
    // tensors, same metadata (whose order in the header varies between writes).
    let a = std::fs::read(w.dir.path().join("model.safetensors")).unwrap();
    let b = std::fs::read(w.dir.path().join("live.safetensors")).unwrap();
    let (_, ma) = safetensors::SafeTensors::read_metadata(&a).unwrap();
    let (_, mb) = safetensors::SafeTensors::read_metadata(&b).unwrap();
    let steps = |m: &safetensors::tensor::Metadata| -> Vec<u64> {
        let text = m.metadata().as_ref().unwrap()["shoal.steps"].clone();
        text.split(',').map(|x| x.parse().unwrap()).collect()
    };
    let (sa, sb) = (steps(&ma), steps(&mb));
    if sa != sb {
        // A step the resumed swarm applied after the checkpoints (trainers stop at the
        // run's last step, but one in flight then still lands): the live model is newer.
        assert!(sa.iter().zip(&sb).all(|(x, y)| y >= x), "{sa:?} vs {sb:?}");
        eprintln!("live export at steps {sb:?}, checkpoints at {sa:?}: not compared");
        return;
    }
    assert_eq!(ma.metadata(), mb.metadata());
    let (ta, tb) = (
        safetensors::SafeTensors::deserialize(&a).unwrap(),
        safetensors::SafeTensors::deserialize(&b).unwrap(),
    );
    let mut names = ta.names();
    names.sort();
    let mut names_b = tb.names();
    names_b.sort();
    assert_eq!(names, names_b);
    for n in names {
        let (x, y) = (ta.tensor(n).unwrap(), tb.tensor(n).unwrap());
        assert!(
            x.shape() == y.shape() && x.data() == y.data(),
            "{n} differs"
        );
    }
}

/// Every `shoal ...` synopsis in the Commands block names a real command, and every
/// `--flag` it shows is in that command's `--help`.
#[test]
fn the_command_synopses_name_only_real_flags() {
    let text = readme();
    let start = text.find("\n## Commands\n").expect("a Commands section");
    let rest = &text[start..];
    let open = rest.find("```sh\n").unwrap() + 6;
    let close = rest[open..].find("```").unwrap() + open;
    // Join each synopsis with its indented continuation lines.
    let mut synopses: Vec<String> = Vec::new();
    for l in rest[open..close].lines() {
        if l.starts_with("shoal ") {
            synopses.push(l.to_string());
        } else if let Some(last) = synopses.last_mut() {
            last.push(' ');
            last.push_str(l.trim());
        }
    }
    assert!(synopses.len() >= 10, "{synopses:?}");
    let mut checked = BTreeSet::new();
    for s in &synopses {
        let words: Vec<&str> = s.split_whitespace().skip(1).collect();
        // The subcommand path: the leading lowercase words.
        let sub: Vec<&str> = words
            .iter()
            .take_while(|w| w.chars().all(|c| c.is_ascii_lowercase()))
            .copied()
            .collect();
        assert!(!sub.is_empty(), "{s}");
        let out = Command::new(BIN).args(&sub).arg("--help").output().unwrap();
        assert!(
            out.status.success(),
            "shoal {} --help failed: {s}",
            sub.join(" ")
        );
        let help = String::from_utf8_lossy(&out.stdout);
        for flag in s
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .filter(|w| w.starts_with("--") && w.len() > 2)
        {
            assert!(
                help.contains(&format!("{flag} "))
                    || help.contains(&format!("{flag}\n"))
                    || help.contains(&format!("{flag},"))
                    || help.contains(&format!("{flag}=")),
                "README shows `shoal {} {flag}`, which its --help does not list",
                sub.join(" ")
            );
            checked.insert(format!("{} {flag}", sub.join(" ")));
        }
    }
    assert!(checked.len() >= 40, "only {} flags checked", checked.len());
}

/// Every ```toml block is a valid part of a run config: added to `configs/tiny.toml`, the
/// config loads and validates.
#[test]
fn the_config_snippets_are_valid() {
    let text = readme();
    let tiny =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml"))
            .unwrap();
    let mut n = 0;
    for (i, part) in text.split("```toml\n").enumerate().skip(1) {
        let snippet = &part[..part.find("```").unwrap()];
        let cfg = format!("{tiny}\n{snippet}");
        shoal::config::RunConfig::from_toml(&cfg, "README")
            .unwrap_or_else(|e| panic!("README's toml block {i} does not load: {e}\n{snippet}"));
        n += 1;
    }
    assert!(n >= 1);
}

/// The quick start's `cargo run --release -- demo` names the built-in demo (which
/// `tests/cli_peer.rs` runs in short), and its test command is this suite.
#[test]
fn the_quick_start_names_real_commands() {
    let quick = block(&readme(), "Quick start");
    assert!(
        quick[0].starts_with("cargo run --release -- demo"),
        "{quick:?}"
    );
    assert!(quick[1].starts_with("cargo test --release"), "{quick:?}");
    let out = Command::new(BIN).args(["demo", "--help"]).output().unwrap();
    assert!(out.status.success());
}
