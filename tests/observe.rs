//! `--metrics` and `--dashboard` of real `shoal peer` processes on 127.0.0.1: the JSON API
//! and the Prometheus metrics agree with the swarm's true state (what `shoal status`
//! reads from the DHT, and what the trainer did).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_shoal");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET `path` on 127.0.0.1:`port`: (status line, body).
fn get(port: u16, path: &str) -> (String, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(dir: &Path, args: &[&str], log: &str) -> Kill {
    let out = std::fs::File::create(dir.join(log)).unwrap();
    Kill(
        Command::new(BIN)
            .args(args)
            .current_dir(dir)
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

fn wait_log(dir: &Path, log: &str, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(dir.join(log)).unwrap_or_default();
        if let Some(l) = text.lines().find(|l| l.contains(needle)) {
            return l.to_string();
        }
        assert!(
            Instant::now() < deadline,
            "{log} never printed {needle:?}: {text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn the_json_api_and_the_metrics_agree_with_the_swarm() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let out = Command::new(BIN)
        .args(["run", "new", cfg.to_str().unwrap(), "--out", "run.toml"])
        .current_dir(d)
        .output()
        .unwrap();
    assert!(out.status.success());
    let (metrics, dash) = (free_port(), free_port());
    let (m, db) = (format!("127.0.0.1:{metrics}"), format!("127.0.0.1:{dash}"));
    let listen = "/ip4/127.0.0.1/tcp/0";
    let _a = spawn(
        d,
        &[
            "peer",
            "--identity",
            "a.key",
            "--run",
            "run.toml",
            "--listen",
            listen,
            "--stage",
            "0",
            "--trainers",
            "0",
            "--metrics",
            &m,
            "--dashboard",
            &db,
        ],
        "a.log",
    );
    let line = wait_log(d, "a.log", "listening on /ip4/127.0.0.1/tcp/");
    let boot = line.trim_start_matches("listening on ").to_string();
    let a_id = boot.rsplit('/').next().unwrap().to_string();
    wait_log(d, "a.log", "dashboard at");
    let _b = spawn(
        d,
        &[
            "peer",
            "--identity",
            "b.key",
            "--run",
            "run.toml",
            "--bootstrap",
            &boot,
            "--listen",
            listen,
            "--stage",
            "1",
            "--trainers",
            "0",
        ],
        "b.log",
    );
    wait_log(d, "b.log", " ready");
    // 20 microbatches of 16: 10 steps of the tiny run's 32 samples.
    let t = Command::new(BIN)
        .args([
            "train",
            "--run",
            "run.toml",
            "--bootstrap",
            &boot,
            "--microbatches",
            "20",
        ])
        .current_dir(d)
        .output()
        .unwrap();
    assert!(t.status.success(), "{}", String::from_utf8_lossy(&t.stderr));
    // What the DHT says, as `shoal status` reads it.
    let status = Command::new(BIN)
        .args(["status", "--bootstrap", &boot, "--json"])
        .current_dir(d)
        .output()
        .unwrap();
    let truth: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let replicas = |v: &serde_json::Value| -> Vec<(u64, String)> {
        let mut out = Vec::new();
        for r in v.as_array().unwrap() {
            for s in r["stages"].as_array().unwrap() {
                for a in s["replicas"].as_array().unwrap() {
                    out.push((
                        s["stage"].as_u64().unwrap(),
                        a["peer"].as_str().unwrap().into(),
                    ));
                }
            }
        }
        out.sort();
        out
    };
    let want = replicas(&truth["runs"]);
    assert_eq!(want.len(), 2, "{truth}");
    // The dashboard's view of the swarm (refreshed every 2 s) converges to it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let api = loop {
        let (code, body) = get(dash, "/api/status");
        assert!(code.contains("200"), "{code}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        if replicas(&v["swarm"]) == want || Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(replicas(&api["swarm"]), want, "{api}");
    // This process's own numbers: its id and stage, and the steps the trainer made.
    let me = &api["self"];
    assert_eq!(me["peer"], a_id.as_str());
    assert_eq!(me["replica"]["stage"], 0);
    let step = me["replica"]["step"].as_u64().unwrap();
    assert!(step >= 5, "{me}");
    let served = me["replica"]["counters"]["served"].as_u64().unwrap();
    // 20 forwards and 20 backwards at least (info calls and averaging come on top).
    assert!(served >= 40, "{me}");
    // The metrics say the same (the swarm is idle now: nothing moves between reads).
    let (code, text) = get(metrics, "/metrics");
    assert!(code.contains("200"), "{code}");
    let value = |name: &str| -> f64 {
        let l = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no {name} in\n{text}"));
        l.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    assert_eq!(value("shoal_step"), step as f64);
    assert_eq!(value("shoal_stage"), 0.0);
    assert!(value("shoal_requests_served_total") >= served as f64);
    assert!(value("shoal_averaging_rounds_total") >= step as f64);
    assert!(
        text.contains("# TYPE shoal_network_bytes counter"),
        "{text}"
    );
    // The dashboard page is one self-contained document; unknown paths are 404.
    let (code, page) = get(dash, "/");
    assert!(code.contains("200") && page.contains("<html"));
    assert!(!page.contains("src=\"http") && !page.contains("href=\"http"));
    assert!(get(dash, "/nope").0.contains("404"));
    let (_, hist) = get(dash, "/api/history");
    let hist: serde_json::Value = serde_json::from_str(&hist).unwrap();
    assert!(!hist.as_array().unwrap().is_empty());
    // A watcher that holds no stage serves the same swarm (`status --serve`).
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let _w = spawn(
        d,
        &["status", "--bootstrap", &boot, "--serve", &addr],
        "watcher.log",
    );
    wait_log(d, "watcher.log", "dashboard at");
    let deadline = Instant::now() + Duration::from_secs(20);
    let seen = loop {
        let v: serde_json::Value = serde_json::from_str(&get(port, "/api/status").1).unwrap();
        if replicas(&v["swarm"]) == want || Instant::now() > deadline {
            break replicas(&v["swarm"]);
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(seen, want);
    // A trainer's dashboard: its links to both replicas with their bytes/s, and its
    // activations' compression (int8: a little under 4x).
    let tport = free_port();
    let taddr = format!("127.0.0.1:{tport}");
    let _t = spawn(
        d,
        &[
            "train",
            "--run",
            "run.toml",
            "--bootstrap",
            &boot,
            "--microbatches",
            "4000",
            "--dashboard",
            &taddr,
            "--eval-every",
            "2",
        ],
        "trainer.log",
    );
    wait_log(d, "trainer.log", "dashboard at");
    let deadline = Instant::now() + Duration::from_secs(30);
    let v = loop {
        let v: serde_json::Value = serde_json::from_str(&get(tport, "/api/status").1).unwrap();
        let moving = v["link_rates"]
            .as_array()
            .is_some_and(|l| l.len() == 2 && l.iter().all(|r| r["out_per_s"].as_f64() > Some(0.0)));
        if (moving && v["self"]["eval_loss"].is_number()) || Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let mut linked: Vec<String> = v["link_rates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["peer"].as_str().unwrap().to_string())
        .collect();
    linked.sort();
    let mut peers: Vec<String> = want.iter().map(|(_, p)| p.clone()).collect();
    peers.sort();
    assert_eq!(linked, peers, "{v}");
    // Calls go out on both links; data comes back on the last stage's (the input
    // gradients). Stage 0 pushes its activations on to stage 1, so only its answers'
    // headers come back to the trainer.
    let last = want
        .iter()
        .find(|(s, _)| *s == 1)
        .map(|(_, p)| p.clone())
        .unwrap();
    for r in v["link_rates"].as_array().unwrap() {
        assert!(r["out_per_s"].as_f64() > Some(0.0), "{v}");
        if r["peer"].as_str() == Some(last.as_str()) {
            assert!(r["in_per_s"].as_f64() > Some(0.0), "{v}");
        }
    }
    let links = v["self"]["links"].as_array().unwrap();
    assert_eq!(links.len(), 2, "{v}");
    let c = &v["self"]["compression"][0];
    assert_eq!(c["kind"], "activations", "{v}");
    assert_eq!(c["codec"], "int8", "{v}");
    let ratio = c["raw"].as_f64().unwrap() / c["wire"].as_f64().unwrap();
    assert!((3.0..4.0).contains(&ratio), "{v}");
    // The swarm's held-out loss, measured by the trainer every 2 s: a cross-entropy over
    // the tiny model's 16 tokens: between 0 and ln 16 ≈ 2.8 for anything trained, 10 at worst.
    let eval = v["self"]["eval_loss"].as_f64().unwrap_or(f64::NAN);
    assert!(eval > 0.0 && eval < 10.0, "{v}");
    assert_eq!(
        v["self"]["stage_replicas"],
        serde_json::json!([1, 1]),
        "{v}"
    );
    let text = get(tport, "/metrics").1;
    assert!(text.contains("shoal_trainer_eval_loss "), "{text}");
    assert!(
        text.contains("shoal_stage_replicas{stage=\"1\"} 1"),
        "{text}"
    );
}
