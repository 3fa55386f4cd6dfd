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
            out.push_str(&format!(
                "  stage {}: {} replicas, {:.1} samples/s{mark}\n",
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
    use crate::dht::record::{BanNote, ANN_VERSION};

    #[test]
    fn the_table_names_the_peers_a_replica_banned_and_why() {
        let ann = |peer: &str, banned: Vec<BanNote>| Announcement {
            v: ANN_VERSION,
            run: "ab".repeat(16),
            peer: peer.into(),
            addrs: Vec::new(),
            stage: 0,
            stages: 1,
            step: 4,
            samples_per_s: 10.0,
            device: "cpu".into(),
            queue: 0,
            queue_cap: 8,
            params_hash: "00".into(),
            issued_ms: 0,
            expires_ms: 1,
            banned,
        };
        let note = BanNote {
            peer: "bad".into(),
            reason: "part chunk 3: value 0 of the chunk is NaN".into(),
        };
        let v = view(
            &"ab".repeat(16),
            1,
            vec![ann("good", vec![note]), ann("bad", vec![])],
        );
        let text = render(&[v]);
        assert!(
            text.contains("banned bad: part chunk 3: value 0 of the chunk is NaN"),
            "{text}"
        );
        assert_eq!(text.matches("banned").count(), 1, "{text}");
    }
}
