//! `shoal probe`: one microbatch forward and backward through the swarm, one replica per
//! stage, to check that a swarm works end to end, training or not: the calls are probes
//! (nothing kept, nothing accumulated), so the run's training is untouched.
//!
//! The replica of each stage is the one with the highest announced throughput. With
//! `check`, when every stage is at step 0, the same pass is computed locally from the
//! deterministic initial parameters and the losses compared.

use super::client::{CallError, StageClient};
use super::registry::{self, RegistryError};
use crate::data::{DataError, Sampler, TokenSource};
use crate::dht::{Announcement, Manifest};
use crate::model::{ModelError, Stage, Upstream};
use crate::net::NetHandle;
use candle_core::{Device, Tensor};
use libp2p::{Multiaddr, PeerId};
use std::time::{Duration, Instant};

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The swarm could not be read.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// A stage has nobody serving it.
    #[error("stage {0} has no live replica; start a peer with --stage {0}")]
    NoReplica(usize),
    /// A call failed.
    #[error("stage {stage} on {peer}: {cause}")]
    Call {
        /// The stage.
        stage: usize,
        /// The replica.
        peer: String,
        /// What went wrong.
        cause: CallError,
    },
    /// The run's data could not be read.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A tensor op failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// An announcement is unusable.
    #[error("bad announcement: {0}")]
    Announcement(String),
    /// At step 0 the swarm's loss is not the local pass's.
    #[error("the swarm's loss {swarm:.6} at step 0 is not the local pass's {local:.6}: a stage computes something else (check every peer runs this shoal version and the run's manifest)")]
    Mismatch {
        /// The swarm's loss.
        swarm: f32,
        /// The local pass's.
        local: f32,
    },
}

/// What the probe saw at one stage.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StageProbe {
    /// The stage.
    pub stage: usize,
    /// The replica called.
    pub peer: String,
    /// The replica's step, from an `info` call before the pass.
    pub step: u64,
    /// Round trip of that `info` call (no tensors), milliseconds.
    pub rtt_ms: f64,
    /// Wall time of the forward call (every stage but the last), milliseconds.
    pub forward_ms: Option<f64>,
    /// Wall time of the backward call, milliseconds.
    pub backward_ms: f64,
    /// Bytes sent to the replica (tensor frames, encoded).
    pub bytes_sent: u64,
    /// Bytes received from it.
    pub bytes_received: u64,
    /// The same tensors as f32, over the bytes that moved: the codec's compression.
    pub codec_ratio: f64,
}

/// What the probe saw.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ProbeReport {
    /// Loss from the last stage.
    pub loss: f32,
    /// Per stage, in stage order.
    pub stages: Vec<StageProbe>,
    /// The same pass computed locally from the initial parameters, when asked and every
    /// stage answered at step 0 (later, the swarm's parameters have moved on).
    pub local_loss: Option<f32>,
}

/// With `--check` on a swarm at step 0, the swarm's loss may differ from the local pass by
/// this fraction (lossy activation codecs); more means a stage computes something else.
const CHECK_TOLERANCE: f32 = 0.05;

/// A stage's announcements, highest announced throughput first.
fn by_throughput(anns: &[Announcement]) -> Vec<&Announcement> {
    let mut v: Vec<&Announcement> = anns.iter().collect();
    v.sort_by(|a, b| b.samples_per_s.total_cmp(&a.samples_per_s));
    v
}

/// A stage's replica as [`route`] found it: its step and the round trip of the `info`
/// call that found it answering (the first call to it, so a dial included).
struct Routed {
    peer: PeerId,
    step: u64,
    rtt_ms: f64,
}

/// Reads of the run's announcements [`route`] makes before it says a stage has none.
const ROUTE_READS: u32 = 4;

/// One replica per stage (see [`route_once`]). A peer that has just joined may find no
/// provider of a stage in its first walk (its routing table holds only its bootstrap
/// peers): a stage without announcements is looked up again after 1, 2 and 4 s.
async fn route(net: &NetHandle, m: &Manifest) -> Result<Vec<Routed>, ProbeError> {
    let mut pause = Duration::from_secs(1);
    for _ in 1..ROUTE_READS {
        match route_once(net, m).await {
            Err(ProbeError::NoReplica(s)) => {
                tracing::debug!(stage = s, "no replica announced yet; looking again");
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            r => return r,
        }
    }
    route_once(net, m).await
}

/// One replica per stage: the one of highest announced throughput that answers (a replica
/// that died is still announced until its record expires), with its addresses handed to
/// the network so it can be dialled.
async fn route_once(net: &NetHandle, m: &Manifest) -> Result<Vec<Routed>, ProbeError> {
    let count = m.config.stages.count;
    let per_stage = registry::read_run(net, &m.id, count)
        .await
        .map_err(RegistryError::from)?;
    let client = StageClient::new(
        net.clone(),
        m.id.clone(),
        m.config.codecs.activations.wire(),
    );
    let mut peers: Vec<Routed> = Vec::with_capacity(count);
    for (s, anns) in per_stage.iter().enumerate() {
        let mut last = ProbeError::NoReplica(s);
        for a in by_throughput(anns) {
            let peer: PeerId = a
                .peer
                .parse()
                .map_err(|e| ProbeError::Announcement(format!("{e}")))?;
            let addrs: Vec<Multiaddr> = a.addrs.iter().filter_map(|x| x.parse().ok()).collect();
            net.add_addresses(peer, addrs)
                .await
                .map_err(RegistryError::from)?;
            let t0 = Instant::now();
            match client.info(peer, s).await {
                Ok(info) => {
                    peers.push(Routed {
                        peer,
                        step: info.step,
                        rtt_ms: ms_since(t0),
                    });
                    break;
                }
                Err(cause) => {
                    last = ProbeError::Call {
                        stage: s,
                        peer: peer.to_string(),
                        cause,
                    }
                }
            }
        }
        if peers.len() == s {
            return Err(last);
        }
    }
    Ok(peers)
}

fn ms_since(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e3
}

/// Runs one microbatch forward and backward through the swarm, one replica per stage,
/// as a probe (`dry` in [`crate::wire::msg::Call::Forward`]): the replicas accumulate
/// nothing, so a probe never changes training, and a swarm at any step answers. Fails
/// only when a stage is missing or broken (a call fails, a loss or gradient is not
/// finite, or with `check` at step 0 the loss is not the local pass's), saying which.
pub async fn probe(net: &NetHandle, m: &Manifest, check: bool) -> Result<ProbeReport, ProbeError> {
    let cfg = &m.config;
    let count = cfg.stages.count;
    let routed = route(net, m).await?;
    let peers: Vec<PeerId> = routed.iter().map(|r| r.peer).collect();
    let source = TokenSource::open(cfg)?;
    let b = Sampler::new(cfg.training.data_seed, u64::MAX).next_batch(
        &source,
        cfg.training.batch_size,
        cfg.model.seq_len,
    );
    let shape = (b.batch, b.seq_len);
    let x = Tensor::from_vec(b.inputs, shape, &Device::Cpu).map_err(ModelError::from)?;
    let y = Tensor::from_vec(b.targets, shape, &Device::Cpu).map_err(ModelError::from)?;
    let client = StageClient::new(net.clone(), m.id.clone(), cfg.codecs.activations.wire());
    let fail = |stage: usize, peer: PeerId| {
        move |cause| ProbeError::Call {
            stage,
            peer: peer.to_string(),
            cause,
        }
    };
    let moved = |c: &StageClient| {
        let k = c.counters();
        [&k.sent, &k.received, &k.raw].map(|a| a.load(std::sync::atomic::Ordering::Relaxed))
    };
    // Each stage's step and round trip, as routing found them, before any tensor moves.
    let mut stages: Vec<StageProbe> = routed
        .iter()
        .enumerate()
        .map(|(s, r)| StageProbe {
            stage: s,
            peer: r.peer.to_string(),
            step: r.step,
            rtt_ms: r.rtt_ms,
            forward_ms: None,
            backward_ms: 0.0,
            bytes_sent: 0,
            bytes_received: 0,
            codec_ratio: 0.0,
        })
        .collect();
    let mut tally = vec![[0u64; 3]; count];
    // Forward through every stage but the last, keeping each input for the backward.
    let mut inputs = vec![x.clone()];
    for (s, &peer) in peers.iter().enumerate().take(count - 1) {
        let (t0, before) = (Instant::now(), moved(&client));
        let out = client
            .probe_forward(peer, s, &inputs[s])
            .await
            .map_err(fail(s, peer))?;
        stages[s].forward_ms = Some(ms_since(t0));
        let after = moved(&client);
        (0..3).for_each(|i| tally[s][i] += after[i] - before[i]);
        inputs.push(out);
    }
    let mut upstream = y.clone();
    let mut loss = f32::NAN;
    for s in (0..count).rev() {
        let peer = peers[s];
        let (t0, before) = (Instant::now(), moved(&client));
        let r = client
            .probe_backward(peer, s, &inputs[s], &upstream)
            .await
            .map_err(fail(s, peer))?;
        stages[s].backward_ms = ms_since(t0);
        let after = moved(&client);
        (0..3).for_each(|i| tally[s][i] += after[i] - before[i]);
        if let Some(l) = r.loss {
            loss = l;
        }
        match r.grad_input {
            Some(g) => upstream = g,
            None if s > 0 => return Err(broken(s, peer, "returned no input gradient")),
            None => {}
        }
    }
    for (st, [sent, received, raw]) in stages.iter_mut().zip(tally) {
        st.bytes_sent = sent;
        st.bytes_received = received;
        st.codec_ratio = raw as f64 / (sent + received).max(1) as f64;
    }
    if !loss.is_finite() {
        return Err(broken(
            count - 1,
            peers[count - 1],
            "returned no finite loss",
        ));
    }
    let at_start = stages.iter().all(|s| s.step == 0);
    let local_loss = if check && at_start {
        let stages: Vec<Stage> = (0..count)
            .map(|i| Stage::new(cfg, i, &Device::Cpu))
            .collect::<Result<_, _>>()?;
        let mut h = x;
        for st in &stages[..count - 1] {
            h = st.forward(&h)?;
        }
        stages[count - 1].backward(&h, Upstream::Targets(&y))?.loss
    } else {
        None
    };
    if let Some(l) = local_loss {
        if (l - loss).abs() > CHECK_TOLERANCE * l.abs() {
            return Err(ProbeError::Mismatch {
                swarm: loss,
                local: l,
            });
        }
    }
    Ok(ProbeReport {
        loss,
        stages,
        local_loss,
    })
}

fn broken(stage: usize, peer: PeerId, what: &str) -> ProbeError {
    ProbeError::Call {
        stage,
        peer: peer.to_string(),
        cause: CallError::Protocol(what.into()),
    }
}

/// Mean held-out loss of the swarm's current parameters over `batches` eval batches:
/// forward only, as probe calls (nothing kept or accumulated, whatever the replicas'
/// step), the loss computed here from the last stage's
/// logits. Uses the highest-throughput replica of each stage that answers.
pub async fn evaluate(net: &NetHandle, m: &Manifest, batches: usize) -> Result<f64, ProbeError> {
    let peers: Vec<PeerId> = route(net, m).await?.iter().map(|r| r.peer).collect();
    evaluate_on(net, m, &peers, batches).await
}

/// [`evaluate`] through the given replicas, one per stage in stage order (dialable: their
/// addresses known to `net`).
pub async fn evaluate_on(
    net: &NetHandle,
    m: &Manifest,
    peers: &[PeerId],
    batches: usize,
) -> Result<f64, ProbeError> {
    let cfg = &m.config;
    if peers.len() != cfg.stages.count {
        return Err(ProbeError::NoReplica(peers.len().min(cfg.stages.count)));
    }
    let source = TokenSource::open(cfg)?;
    let mut sampler = Sampler::eval(cfg.training.data_seed);
    let client = StageClient::new(net.clone(), m.id.clone(), cfg.codecs.activations.wire());
    let mut total = 0.0;
    for _ in 0..batches.max(1) {
        let b = sampler.next_batch(&source, cfg.training.batch_size, cfg.model.seq_len);
        let shape = (b.batch, b.seq_len);
        let mut h = Tensor::from_vec(b.inputs, shape, &Device::Cpu).map_err(ModelError::from)?;
        let y = Tensor::from_vec(b.targets, shape, &Device::Cpu).map_err(ModelError::from)?;
        for (s, &peer) in peers.iter().enumerate() {
            h = client
                .probe_forward(peer, s, &h)
                .await
                .map_err(|cause| ProbeError::Call {
                    stage: s,
                    peer: peer.to_string(),
                    cause,
                })?;
        }
        let (bb, t, v) = h.dims3().map_err(ModelError::from)?;
        let loss = candle_nn::loss::cross_entropy(
            &h.reshape((bb * t, v)).map_err(ModelError::from)?,
            &y.flatten_all().map_err(ModelError::from)?,
        )
        .and_then(|l| l.to_scalar::<f32>())
        .map_err(ModelError::from)?;
        total += loss as f64;
    }
    Ok(total / batches.max(1) as f64)
}
