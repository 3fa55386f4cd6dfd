//! `shoal run new`, `peer`, `status` and `swarm key` as a user runs them: real processes on
//! 127.0.0.1, real files, one-line errors.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_shoal");

fn shoal(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run shoal")
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn one_line_error(out: &Output, needle: &str) {
    assert!(!out.status.success(), "expected failure");
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "stderr: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(lines[0].contains(needle), "{err:?} lacks {needle:?}");
    assert!(!err.contains("panicked"), "{err}");
}

/// A running peer: the child and its printed lines, as they arrive.
struct PeerProc {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl PeerProc {
    fn spawn(dir: &Path, args: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .arg("peer")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn peer");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::sync_channel(4096);
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines: rx,
            seen: Vec::new(),
        }
    }

    /// Waits for a line containing `needle`.
    fn wait_for(&mut self, needle: &str) -> String {
        if let Some(l) = self.seen.iter().find(|l| l.contains(needle)) {
            return l.clone();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
                self.seen.push(l.clone());
                if l.contains(needle) {
                    return l;
                }
            }
        }
        panic!("peer never printed {needle:?}; printed {:?}", self.seen);
    }

    fn addr(&mut self) -> String {
        let l = self.wait_for("listening on /ip4/127.0.0.1/tcp/");
        l.trim_start_matches("listening on ").to_string()
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn new_run(dir: &Path) -> String {
    let cfg = root().join("configs/tiny.toml");
    let out = shoal(
        dir,
        &["run", "new", cfg.to_str().unwrap(), "--out", "run.toml"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn status_peers(dir: &Path, boot: &str, run: &str) -> Vec<String> {
    let out = shoal(
        dir,
        &["status", "--bootstrap", boot, "--run", run, "--json"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut peers = Vec::new();
    for r in v["runs"].as_array().unwrap() {
        for s in r["stages"].as_array().unwrap() {
            for a in s["replicas"].as_array().unwrap() {
                peers.push(a["peer"].as_str().unwrap().to_string());
            }
        }
    }
    peers.sort();
    peers
}

#[test]
fn run_new_is_canonical_and_the_id_is_its_hash() {
    let dir = tempfile::tempdir().unwrap();
    let id = new_run(dir.path());
    assert_eq!(id.len(), 32);
    // The same run written differently (a comment, reordered defaults) has the same id.
    let text = std::fs::read_to_string(root().join("configs/tiny.toml")).unwrap();
    std::fs::write(dir.path().join("same.toml"), format!("# a comment\n{text}")).unwrap();
    let out = shoal(dir.path(), &["run", "new", "same.toml", "--out", "b.toml"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), id);
    // The written manifest is itself a config that hashes to the same id.
    let out = shoal(dir.path(), &["run", "new", "run.toml", "--out", "c.toml"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), id);
    // Any change to the run changes the id.
    std::fs::write(
        dir.path().join("other.toml"),
        text.replace("lr = 3e-3", "lr = 2e-3"),
    )
    .unwrap();
    let out = shoal(dir.path(), &["run", "new", "other.toml", "--out", "d.toml"]);
    assert!(out.status.success());
    assert_ne!(String::from_utf8_lossy(&out.stdout).trim(), id);
    one_line_error(
        &shoal(dir.path(), &["run", "new", "missing.toml"]),
        "cannot read config",
    );
}

#[test]
fn network_commands_refuse_bad_input_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    new_run(d);
    one_line_error(
        &shoal(
            d,
            &["peer", "--run", "run.toml", "--bootstrap", "not-an-addr"],
        ),
        "is not a multiaddr",
    );
    one_line_error(
        &shoal(d, &["peer", "--run", "nope.toml", "--identity", "k"]),
        "cannot read config",
    );
    one_line_error(
        &shoal(
            d,
            &[
                "peer",
                "--run",
                "run.toml",
                "--stage",
                "9",
                "--identity",
                "k",
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
            ],
        ),
        "out of range",
    );
    one_line_error(
        &shoal(
            d,
            &[
                "peer",
                "--run",
                &"a".repeat(32),
                "--identity",
                "k",
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
            ],
        ),
        "not found",
    );
    std::fs::write(d.join("bad.key"), "hello").unwrap();
    one_line_error(
        &shoal(d, &["peer", "--run", "run.toml", "--swarm-key", "bad.key"]),
        "not a libp2p swarm key",
    );
    one_line_error(
        &shoal(d, &["peer", "--run", "run.toml", "--identity", "bad.key"]),
        "not a shoal identity key",
    );
    one_line_error(&shoal(d, &["status"]), "--bootstrap");
    one_line_error(&shoal(d, &["train"]), "pass --run ID --bootstrap MULTIADDR");
    one_line_error(
        &shoal(d, &["train", "--run", "run.toml"]),
        "--bootstrap MULTIADDR is required",
    );
    one_line_error(
        &shoal(d, &["demo", "--replicas", "1"]),
        "churn needs at least 2 replicas",
    );
    one_line_error(
        &shoal(
            d,
            &[
                "status",
                "--bootstrap",
                "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWF6JZRfF6yvtKr3JL8dKPrhWzGyK1nEMtZAgZUAYfcgJd",
            ],
        ),
        "cannot reach any bootstrap peer",
    );
    // A swarm key is written once, in the libp2p format, readable only by its owner.
    let out = shoal(d, &["swarm", "key", "--out", "s.key"]);
    assert!(out.status.success());
    let text = std::fs::read_to_string(d.join("s.key")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[..2], ["/key/swarm/psk/1.0.0/", "/base16/"]);
    assert_eq!(lines[2].len(), 64);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d.join("s.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    one_line_error(
        &shoal(d, &["swarm", "key", "--out", "s.key"]),
        "already exists",
    );
    assert_eq!(std::fs::read_to_string(d.join("s.key")).unwrap(), text);
}

#[test]
fn identity_persists_and_killed_peers_expire_from_status() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = new_run(d);
    let listen = ["--listen", "/ip4/127.0.0.1/tcp/0"];
    let ttl = ["--announce-ttl", "3", "--trainers", "0"];
    let mut boot = PeerProc::spawn(
        d,
        &[
            &[
                "--run",
                "run.toml",
                "--identity",
                "boot.key",
                "--stage",
                "0",
            ][..],
            &listen,
            &ttl,
        ]
        .concat(),
    );
    let baddr = boot.addr();
    boot.wait_for("ready");
    let boot_id = baddr.rsplit('/').next().unwrap().to_string();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d.join("boot.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let args = [
        &["--run", &run, "--identity", "v.key", "--bootstrap", &baddr][..],
        &listen,
        &ttl,
    ]
    .concat();
    let mut victim = PeerProc::spawn(d, &args);
    let vaddr = victim.addr();
    victim.wait_for("ready");
    let victim_id = vaddr.rsplit('/').next().unwrap().to_string();
    let mut want = vec![boot_id.clone(), victim_id.clone()];
    want.sort();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        seen = status_peers(d, &baddr, &run);
        if seen == want {
            break;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(seen, want, "both peers in status");
    // One microbatch through both stages over the network, checked against a local pass.
    let out = shoal(
        d,
        &["probe", "--run", &run, "--bootstrap", &baddr, "--check"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let loss = |prefix: &str| -> f64 {
        let l = text.lines().find(|l| l.starts_with(prefix)).unwrap();
        l.split_whitespace()
            .nth(prefix.split(' ').count())
            .unwrap()
            .parse()
            .unwrap()
    };
    let (remote, local) = (loss("loss"), loss("local loss"));
    assert!((remote - local).abs() < 1e-3 * local, "{text}");
    assert!(
        (remote - 16f64.ln()).abs() < 0.2,
        "initial loss ≈ ln(vocab): {text}"
    );
    // SIGKILL: no withdrawal; the announcement must expire on its own.
    let killed_at = Instant::now();
    victim.child.kill().unwrap();
    victim.child.wait().unwrap();
    let deadline = killed_at + Duration::from_secs(12);
    while Instant::now() < deadline {
        seen = status_peers(d, &baddr, &run);
        if seen == [boot_id.clone()] {
            break;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(seen, vec![boot_id.clone()], "the killed peer left status");
    eprintln!(
        "killed peer left status after {:.1} s (ttl 3 s)",
        killed_at.elapsed().as_secs_f64()
    );
    // The same identity file gives the same peer id after a restart.
    drop(victim);
    let mut again = PeerProc::spawn(d, &args);
    assert_eq!(again.addr().rsplit('/').next().unwrap(), victim_id);
}

/// `shoal status` through a peer that serves no stage: it says which bootstrap peer it
/// asked and what to check, on one line that ends with a newline.
#[test]
fn status_with_nothing_announced_names_the_bootstrap_and_what_to_check() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    new_run(d);
    let mut boot = PeerProc::spawn(
        d,
        &[
            "--run",
            "run.toml",
            "--stage",
            "none",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
        ],
    );
    let baddr = boot.addr();
    boot.wait_for("ready");
    let out = shoal(d, &["status", "--bootstrap", &baddr]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.ends_with('\n'), "{text:?}");
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(
        text.contains(&baddr) && text.contains("--swarm-key"),
        "{text}"
    );
}

/// Two peers, one per stage, each with the trainer every `shoal peer` runs by default:
/// each trainer calls its own peer's stage too (through a node of its own: a node cannot
/// dial itself), so the swarm trains. Before, neither trainer completed a microbatch.
#[test]
fn two_peers_with_their_default_trainers_train() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    new_run(d);
    let listen = ["--listen", "/ip4/127.0.0.1/tcp/0"];
    let mut a = PeerProc::spawn(
        d,
        &[
            &["--run", "run.toml", "--identity", "a.key", "--stage", "0"][..],
            &listen,
        ]
        .concat(),
    );
    let baddr = a.addr();
    a.wait_for("ready");
    let mut b = PeerProc::spawn(
        d,
        &[
            &["--run", "run.toml", "--identity", "b.key", "--stage", "1"][..],
            &["--bootstrap", &baddr],
            &listen,
        ]
        .concat(),
    );
    b.wait_for("ready");
    for p in [&mut a, &mut b] {
        let deadline = Instant::now() + Duration::from_secs(60);
        let completed = loop {
            let l = p.wait_for("trainers: step");
            p.seen.retain(|s| *s != l);
            let n: u64 = l
                .split_whitespace()
                .skip_while(|w| *w != "completed")
                .nth(1)
                .unwrap()
                .parse()
                .unwrap();
            if n > 0 || Instant::now() > deadline {
                break n;
            }
        };
        assert!(
            completed > 0,
            "a trainer beside its stage completed nothing"
        );
    }
}
