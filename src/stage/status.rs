//! What `shoal status` shows: per run and stage, the replicas, the stage's total
//! throughput, and the bottleneck. Gathering is async (DHT reads); rendering is pure.

use super::registry::{self, RegistryError};
use super::select;
use crate::dht::Announcement;
use crate::net::NetHandle;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// One stage in the status.
#[derive(Debug, Clone, Serialize)]
pub struct StageView {
    /// The stage.
    pub stage: usize,
    /// Sum of the replicas' samples/s.
    pub total_samples_per_s: f64,
    /// The live replicas.
    pub replicas: Vec<Announcement>,
    /// The replica with the slowest measured uplink for averaging (none measured yet:
    /// none): the link a stage's rounds wait on.
    pub slowest_link: Option<SlowLink>,
}

/// The slowest measured uplink of a stage.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlowLink {
    /// The replica.
    pub peer: String,
    /// Its uplink, bytes/s.
    pub uplink: u64,
}

/// The replica of `replicas` with the slowest measured uplink.
fn slowest(replicas: &[Announcement]) -> Option<SlowLink> {
    replicas
        .iter()
        .filter(|a| a.uplink > 0)
        .min_by_key(|a| a.uplink)
        .map(|a| SlowLink {
            peer: a.peer.clone(),
            uplink: a.uplink,
        })
}

/// One run in the status.
#[derive(Debug, Clone, Serialize)]
pub struct RunView {
    /// Run id.
    pub run: String,
    /// Stages, in order.
    pub stages: Vec<StageView>,
    /// The weakest stage.
    pub bottleneck: Option<usize>,
}

/// Builds the view of a run from its announcements.
pub fn view(run: &str, stages: usize, anns: Vec<Announcement>) -> RunView {
    let loads = select::loads(stages, &anns);
    let mut by_stage: Vec<Vec<Announcement>> = vec![Vec::new(); stages];
    for a in anns {
        if let Some(v) = by_stage.get_mut(a.stage as usize) {
            v.push(a);
        }
    }
    RunView {
        run: run.to_string(),
        bottleneck: select::weakest(&loads),
        stages: by_stage
            .into_iter()
            .zip(loads)
            .map(|(replicas, l)| StageView {
                stage: l.stage,
                total_samples_per_s: l.total,
                slowest_link: slowest(&replicas),
                replicas,
            })
            .collect(),
    }
}

/// Reads the swarm: one run when `run` is given (its stage count from its manifest), else
/// every run some serving peer announces.
pub async fn gather(net: &NetHandle, run: Option<&str>) -> Result<Vec<RunView>, RegistryError> {
    match run {
        Some(id) => {
            let m = registry::fetch_manifest(net, id, Duration::from_secs(3)).await?;
            let per_stage = registry::read_run(net, id, m.config.stages.count).await?;
            Ok(vec![view(
                id,
                m.config.stages.count,
                per_stage.into_iter().flatten().collect(),
            )])
        }
        None => {
            let mut runs: BTreeMap<String, Vec<Announcement>> = BTreeMap::new();
            for a in registry::read_all(net).await? {
                runs.entry(a.run.clone()).or_default().push(a);
            }
            Ok(runs
                .into_iter()
                .map(|(id, anns)| {
                    let stages = anns.iter().map(|a| a.stages as usize).max().unwrap_or(1);
                    view(&id, stages, anns)
                })
                .collect())
        }
    }
}

/// The human table.
pub fn render(runs: &[RunView]) -> String {
    if runs.is_empty() {
        return "no serving peers found\n".to_string();
    }
    let mut out = String::new();
    for r in runs {
        let n: usize = r.stages.iter().map(|s| s.replicas.len()).sum();
        out.push_str(&format!(
            "run {}: {} stages, {n} replicas\n",
            r.run,
            r.stages.len()
        ));
        for s in &r.stages {
            let mark = if r.bottleneck == Some(s.stage) {
                "  <- bottleneck"
            } else {
                ""
            };
            let link = s.slowest_link.as_ref().map_or_else(String::new, |l| {
                let short = &l.peer[l.peer.len().saturating_sub(6)..];
                format!(
                    ", slowest uplink {:.1} MB/s (…{short})",
                    l.uplink as f64 / 1e6
                )
            });
            out.push_str(&format!(
                "  stage {}: {} replicas, {:.1} samples/s{link}{mark}\n",
                s.stage,
                s.replicas.len(),
                s.total_samples_per_s
            ));
            for a in &s.replicas {
                out.push_str(&format!(
                    "    {}  {:<8} {:>9.1} samples/s  queue {}/{}  step {}  params {}\n",
                    a.peer, a.device, a.samples_per_s, a.queue, a.queue_cap, a.step, a.params_hash
                ));
                for b in &a.banned {
                    out.push_str(&format!("      banned {}: {}\n", b.peer, b.reason));
                }
            }
        }
    }
    out
}

/// The JSON form (`--json`).
pub fn to_json(runs: &[RunView]) -> String {
    serde_json::to_string_pretty(&serde_json::json!({ "runs": runs })).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dht::record::BanNote;

    fn ann(peer: &str, stage: u32, banned: Vec<BanNote>, uplink: u64) -> Announcement {
        Announcement {
            banned,
            uplink,
            ..Announcement::for_tests(peer, stage)
        }
    }

    #[test]
    fn the_table_names_the_peers_a_replica_banned_and_why() {
        let note = BanNote {
            peer: "bad".into(),
            reason: "part chunk 3: value 0 of the chunk is NaN".into(),
        };
        let v = view(
            &"ab".repeat(16),
            2,
            vec![ann("good", 0, vec![note], 0), ann("bad", 0, vec![], 0)],
        );
        let text = render(&[v]);
        assert!(
            text.contains("banned bad: part chunk 3: value 0 of the chunk is NaN"),
            "{text}"
        );
        assert_eq!(text.matches("banned").count(), 1, "{text}");
    }

    #[test]
    fn each_stage_names_its_slowest_measured_uplink() {
        let v = view(
            &"ab".repeat(16),
            2,
            vec![
                ann("fastpeer1", 0, vec![], 9_000_000),
                ann("slowpeer2", 0, vec![], 1_500_000),
                ann("unmeasured", 0, vec![], 0),
                ann("alone3", 1, vec![], 0),
            ],
        );
        assert_eq!(
            v.stages[0].slowest_link,
            Some(SlowLink {
                peer: "slowpeer2".into(),
                uplink: 1_500_000
            })
        );
        assert_eq!(v.stages[1].slowest_link, None);
        let text = render(&[v]);
        assert!(
            text.contains("stage 0: 3 replicas, 30.0 samples/s, slowest uplink 1.5 MB/s (…wpeer2)"),
            "{text}"
        );
        assert!(
            text.contains("stage 1: 1 replicas, 10.0 samples/s\n")
                || text.contains("stage 1: 1 replicas, 10.0 samples/s  <-"),
            "{text}"
        );
    }
}
