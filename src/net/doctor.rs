//! `shoal doctor`: a reachability self-test. Joins through the bootstrap addresses with a
//! throwaway identity, listening like a peer would, and reports what others see: the
//! round trip to each bootstrap peer, the addresses others observe, whether a dial-back
//! works (AutoNAT v2), the NAT as far as that tells, a relay reservation when it does not,
//! and what to do about each failure — one screen, or JSON.

use super::reach::{NetStatus, Reachability};
use super::{NetConfig, NetError};
use libp2p::multiaddr::Protocol;
use libp2p::Multiaddr;
use serde::Serialize;
use std::time::{Duration, Instant};

/// One bootstrap address tried.
#[derive(Debug, Clone, Serialize)]
pub struct BootstrapCheck {
    /// The address.
    pub addr: String,
    /// Milliseconds to a connection (transport, security, identify), if it answered.
    pub connect_ms: Option<f64>,
    /// Its ping round trip, milliseconds.
    pub rtt_ms: Option<f64>,
    /// Its agent version.
    pub agent: Option<String>,
    /// Why it did not answer.
    pub error: Option<String>,
}

/// What `shoal doctor` found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Each bootstrap address.
    pub bootstrap: Vec<BootstrapCheck>,
    /// Addresses this peer listens on.
    pub listening: Vec<String>,
    /// What the network learned (observed and confirmed addresses, relay, refusals).
    pub status: NetStatus,
    /// The NAT, as far as the observed addresses and the dial-backs tell.
    pub nat: String,
    /// One line: can others reach a peer on this machine, and how.
    pub verdict: String,
    /// What to do, if anything.
    pub advice: Vec<String>,
}

impl Report {
    /// Whether a peer here can join: some bootstrap peer answered.
    pub fn joined(&self) -> bool {
        self.bootstrap.iter().any(|b| b.connect_ms.is_some())
    }
}

/// Runs the self-test: waits up to `wait` for a verdict (a dial-back, and a relay slot
/// when the dial-back fails).
pub async fn diagnose(
    mut cfg: NetConfig,
    bootstrap: &[Multiaddr],
    wait: Duration,
) -> Result<Report, NetError> {
    cfg.dht_server = false;
    let n_listen = cfg.listen.len();
    let net = super::start(cfg)?;
    let listening: Vec<String> = net
        .wait_listening(n_listen, Duration::from_secs(5))
        .await?
        .iter()
        .map(|a| a.to_string())
        .collect();
    let mut checks = Vec::new();
    for a in bootstrap {
        let t = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(15), net.dial(a.clone())).await;
        let (connect_ms, error) = match r {
            Ok(Ok(_)) => (Some(t.elapsed().as_secs_f64() * 1e3), None),
            Ok(Err(e)) => (None, Some(e.to_string())),
            Err(_) => (None, Some("no answer in 15 s".to_string())),
        };
        checks.push(BootstrapCheck {
            addr: a.to_string(),
            connect_ms,
            rtt_ms: None,
            agent: None,
            error,
        });
    }
    let deadline = Instant::now() + wait;
    let mut status = net.status().await?;
    if checks.iter().any(|c| c.connect_ms.is_some()) {
        let _ = net.bootstrap().await;
        loop {
            status = net.status().await?;
            let pinged = bootstrap.iter().all(|a| {
                super::peer_of(a).is_none_or(|p| {
                    status
                        .remotes
                        .get(&p.to_string())
                        .is_none_or(|r| r.rtt_ms.is_some())
                })
            });
            let settled = match status.reachability {
                Reachability::Public => true,
                Reachability::Private => status.relayed_addr.is_some(),
                Reachability::Unknown => false,
            };
            if (settled && pinged) || Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    net.shutdown().await;
    for (c, a) in checks.iter_mut().zip(bootstrap) {
        if let Some(r) = super::peer_of(a).and_then(|p| status.remotes.get(&p.to_string())) {
            c.rtt_ms = r.rtt_ms;
            c.agent = Some(r.agent.clone());
        }
    }
    Ok(judge(checks, listening, status))
}

fn ip_port(a: &str) -> Option<(String, u16)> {
    let m: Multiaddr = a.parse().ok()?;
    let mut ip = None;
    let mut port = None;
    for p in m.iter() {
        match p {
            Protocol::Ip4(x) => ip = Some(x.to_string()),
            Protocol::Ip6(x) => ip = Some(x.to_string()),
            Protocol::Tcp(x) => port = Some(x),
            _ => {}
        }
    }
    Some((ip?, port?))
}

/// The verdict and advice from what was measured (pure, so it is tested).
pub fn judge(bootstrap: Vec<BootstrapCheck>, listening: Vec<String>, status: NetStatus) -> Report {
    let joined = bootstrap.iter().any(|b| b.connect_ms.is_some());
    let local: Vec<(String, u16)> = listening.iter().filter_map(|a| ip_port(a)).collect();
    let seen: Vec<(String, u16)> = status.observed.iter().filter_map(|a| ip_port(a)).collect();
    let translated = seen
        .iter()
        .any(|(ip, _)| !local.iter().any(|(l, _)| l == ip));
    let port_kept = seen.iter().any(|(_, p)| local.iter().any(|(_, l)| l == p));
    let nat = if seen.is_empty() {
        "unknown: no peer told us the address it sees".to_string()
    } else if !translated {
        match status.reachability {
            Reachability::Private => "no NAT, but a firewall drops inbound connections".into(),
            _ => "no NAT: others see this machine's own address".into(),
        }
    } else if port_kept {
        "behind NAT that keeps the port (hole punching usually works)".into()
    } else {
        "behind NAT that changes the port (hole punching may fail; a relay carries the traffic)"
            .into()
    };
    let mut advice = Vec::new();
    let verdict = if !joined {
        advice.push(
            "check the bootstrap address (with /p2p/<peer id>), that the peer runs, and --swarm-key for a private swarm"
                .into(),
        );
        if bootstrap.iter().any(|b| {
            b.error
                .as_deref()
                .is_some_and(|e| e.contains("wire protocol"))
        }) {
            advice
                .push("the bootstrap peer runs another shoal version: install the same one".into());
        }
        "cannot join: no bootstrap peer answered".to_string()
    } else {
        match (status.reachability, &status.relayed_addr) {
            (Reachability::Public, _) => format!(
                "reachable directly at {}",
                status.external.first().map(String::as_str).unwrap_or("?")
            ),
            (Reachability::Private, Some(r)) => {
                advice.push(format!(
                    "for direct connections, forward TCP port {} on your router to this machine and pass --listen with it",
                    local.first().map(|(_, p)| *p).unwrap_or(0)
                ));
                format!("reachable through a relay at {r}; direct connections by hole punching")
            }
            (Reachability::Private, None) => {
                advice.push("no relay slot: ask the swarm's operator to run a peer with --relay-server, or forward a port".into());
                "not reachable: dial-backs failed and no relay took a reservation".into()
            }
            (Reachability::Unknown, _) => {
                advice.push("no dial-back answered in time: try again, or with more bootstrap peers (they test us)".into());
                "unknown: no peer tested whether it can dial us back".into()
            }
        }
    };
    Report {
        bootstrap,
        listening,
        status,
        nat,
        verdict,
        advice,
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "shoal doctor: what other peers see of this machine")?;
        for b in &self.bootstrap {
            match (b.connect_ms, &b.error) {
                (Some(ms), _) => writeln!(
                    f,
                    "  bootstrap  {} answered in {ms:.0} ms, round trip {}, {}",
                    b.addr,
                    b.rtt_ms.map_or("?".into(), |r| format!("{r:.1} ms")),
                    b.agent.as_deref().unwrap_or("agent unknown")
                )?,
                (None, e) => writeln!(
                    f,
                    "  bootstrap  {} FAILED: {}",
                    b.addr,
                    e.as_deref().unwrap_or("?")
                )?,
            }
        }
        let list = |v: &[String]| {
            if v.is_empty() {
                "none".to_string()
            } else {
                v.join(", ")
            }
        };
        writeln!(f, "  listening  {}", list(&self.listening))?;
        writeln!(f, "  seen as    {}", list(&self.status.observed))?;
        let dial = match self.status.reachability {
            Reachability::Public => format!("yes: {}", list(&self.status.external)),
            Reachability::Private => format!(
                "no: {}",
                self.status
                    .failed_probes
                    .last()
                    .map_or("?".to_string(), |(a, why)| format!(
                        "the dial-back to {a} failed ({why})"
                    ))
            ),
            Reachability::Unknown => "not tested".into(),
        };
        writeln!(f, "  dialable   {dial}")?;
        writeln!(f, "  NAT        {}", self.nat)?;
        if let Some(r) = &self.status.relayed_addr {
            writeln!(f, "  relay      slot reserved: {r}")?;
        }
        for (p, why) in &self.status.refused {
            writeln!(f, "  refused    {p}: {why}")?;
        }
        writeln!(f, "  verdict    {}", self.verdict)?;
        for a in &self.advice {
            writeln!(f, "  to do      {a}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(ok: bool) -> BootstrapCheck {
        BootstrapCheck {
            addr: "/ip4/10.77.0.1/tcp/4001".into(),
            connect_ms: ok.then_some(12.0),
            rtt_ms: ok.then_some(3.0),
            agent: ok.then(|| "shoal/0.1.0".to_string()),
            error: (!ok).then(|| "connection refused".to_string()),
        }
    }

    #[test]
    fn a_peer_behind_nat_with_a_relay_is_told_how_it_is_reached() {
        let status = NetStatus {
            reachability: Reachability::Private,
            observed: vec!["/ip4/10.77.0.11/tcp/4101".into()],
            relayed_addr: Some("/ip4/10.77.0.1/tcp/4001/p2p/R/p2p-circuit".into()),
            ..NetStatus::default()
        };
        let r = judge(
            vec![check(true)],
            vec!["/ip4/192.168.1.2/tcp/4101".into()],
            status,
        );
        assert!(r.joined());
        assert!(r.nat.contains("keeps the port"), "{}", r.nat);
        assert!(r.verdict.contains("through a relay"), "{}", r.verdict);
        assert!(
            r.advice.iter().any(|a| a.contains("port 4101")),
            "{:?}",
            r.advice
        );
        let screen = r.to_string();
        assert!(
            screen.contains("slot reserved") && screen.lines().count() < 20,
            "{screen}"
        );
    }

    #[test]
    fn no_bootstrap_means_cannot_join_and_says_what_to_check() {
        let r = judge(vec![check(false)], vec![], NetStatus::default());
        assert!(!r.joined());
        assert!(r.verdict.starts_with("cannot join"));
        assert!(r.advice[0].contains("--swarm-key"));
    }

    #[test]
    fn a_public_peer_is_reachable_directly() {
        let status = NetStatus {
            reachability: Reachability::Public,
            observed: vec!["/ip4/127.0.0.1/tcp/5000".into()],
            external: vec!["/ip4/127.0.0.1/tcp/5000".into()],
            ..NetStatus::default()
        };
        let r = judge(
            vec![check(true)],
            vec!["/ip4/127.0.0.1/tcp/5000".into()],
            status,
        );
        assert!(r.nat.starts_with("no NAT"), "{}", r.nat);
        assert!(r.verdict.starts_with("reachable directly"), "{}", r.verdict);
        assert!(r.advice.is_empty());
    }
}
