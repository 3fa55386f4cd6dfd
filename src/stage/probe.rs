//! `shoal probe`: one microbatch forward and backward through the swarm, one replica per
//! stage, to check that a swarm works end to end (the trainer proper comes later).
//!
//! The replica of each stage is the one with the highest announced throughput. With
//! `check`, the same pass is computed locally from the deterministic initial parameters and
//! the losses compared, which holds while the swarm is at step 0.

use super::client::{CallError, StageClient};
use super::registry::{self, RegistryError};
use crate::data::{DataError, Sampler, TokenSource};
use crate::dht::{Announcement, Manifest};
use crate::model::{ModelError, Stage, Upstream};
use crate::net::NetHandle;
use candle_core::{Device, Tensor};
use libp2p::{Multiaddr, PeerId};
use std::time::Instant;

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
}

/// One call of the probe.
#[derive(Debug, Clone)]
pub struct Hop {
    /// Stage called.
    pub stage: usize,
    /// `forward` or `backward`.
    pub op: &'static str,
    /// Replica.
    pub peer: String,
    /// Wall time of the call.
    pub ms: f64,
}

/// What the probe saw.
#[derive(Debug, Clone)]
pub struct ProbeReport {
    /// Loss from the last stage.
    pub loss: f32,
    /// Calls in order.
    pub hops: Vec<Hop>,
    /// The same pass computed locally, when asked.
    pub local_loss: Option<f32>,
}

fn pick(anns: &[Announcement]) -> Option<&Announcement> {
    anns.iter()
        .max_by(|a, b| a.samples_per_s.total_cmp(&b.samples_per_s))
}

/// One replica per stage (the highest announced throughput), with its addresses handed
/// to the network so it can be dialled.
async fn route(net: &NetHandle, m: &Manifest) -> Result<Vec<PeerId>, ProbeError> {
    let count = m.config.stages.count;
    let per_stage = registry::read_run(net, &m.id, count)
        .await
        .map_err(RegistryError::from)?;
    let mut peers: Vec<PeerId> = Vec::with_capacity(count);
    for (s, anns) in per_stage.iter().enumerate() {
        let a = pick(anns).ok_or(ProbeError::NoReplica(s))?;
        let peer: PeerId = a
            .peer
            .parse()
            .map_err(|e| ProbeError::Announcement(format!("{e}")))?;
        let addrs: Vec<Multiaddr> = a.addrs.iter().filter_map(|x| x.parse().ok()).collect();
        net.add_addresses(peer, addrs)
            .await
            .map_err(RegistryError::from)?;
        peers.push(peer);
    }
    Ok(peers)
}

/// Runs one microbatch through the swarm.
pub async fn probe(net: &NetHandle, m: &Manifest, check: bool) -> Result<ProbeReport, ProbeError> {
    let cfg = &m.config;
    let count = cfg.stages.count;
    let peers = route(net, m).await?;
    let source = TokenSource::open(cfg)?;
    let b = Sampler::new(cfg.training.data_seed, u64::MAX).next_batch(
        &source,
        cfg.training.batch_size,
        cfg.model.seq_len,
    );
    let shape = (b.batch, b.seq_len);
    let x = Tensor::from_vec(b.inputs, shape, &Device::Cpu).map_err(ModelError::from)?;
    let y = Tensor::from_vec(b.targets, shape, &Device::Cpu).map_err(ModelError::from)?;
    let client = StageClient::new(net.clone(), m.id.clone(), cfg.codecs.activations);
    let mut hops = Vec::new();
    let fail = |stage: usize, peer: PeerId| {
        move |cause| ProbeError::Call {
            stage,
            peer: peer.to_string(),
            cause,
        }
    };
    // Forward through every stage but the last, keeping each input for the backward.
    let mut inputs = vec![x.clone()];
    for (s, &peer) in peers.iter().enumerate().take(count - 1) {
        let t0 = Instant::now();
        let out = client
            .forward(peer, s, 0, 0, &inputs[s])
            .await
            .map_err(fail(s, peer))?;
        hops.push(Hop {
            stage: s,
            op: "forward",
            peer: peer.to_string(),
            ms: t0.elapsed().as_secs_f64() * 1e3,
        });
        inputs.push(out);
    }
    let mut upstream = y.clone();
    let mut loss = f32::NAN;
    for s in (0..count).rev() {
        let peer = peers[s];
        let t0 = Instant::now();
        let r = client
            .backward(peer, s, 0, 0, &inputs[s], &upstream)
            .await
            .map_err(fail(s, peer))?;
        hops.push(Hop {
            stage: s,
            op: "backward",
            peer: peer.to_string(),
            ms: t0.elapsed().as_secs_f64() * 1e3,
        });
        if let Some(l) = r.loss {
            loss = l;
        }
        if let Some(g) = r.grad_input {
            upstream = g;
        }
    }
    let local_loss = if check {
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
    Ok(ProbeReport {
        loss,
        hops,
        local_loss,
    })
}

/// Mean held-out loss of the swarm's current parameters over `batches` eval batches:
/// forward only (nothing is accumulated), the loss computed here from the last stage's
/// logits. Uses the highest-throughput replica of each stage.
pub async fn evaluate(net: &NetHandle, m: &Manifest, batches: usize) -> Result<f64, ProbeError> {
    let peers = route(net, m).await?;
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
    let client = StageClient::new(net.clone(), m.id.clone(), cfg.codecs.activations);
    let mut total = 0.0;
    for _ in 0..batches.max(1) {
        let b = sampler.next_batch(&source, cfg.training.batch_size, cfg.model.seq_len);
        let shape = (b.batch, b.seq_len);
        let mut h = Tensor::from_vec(b.inputs, shape, &Device::Cpu).map_err(ModelError::from)?;
        let y = Tensor::from_vec(b.targets, shape, &Device::Cpu).map_err(ModelError::from)?;
        for (s, &peer) in peers.iter().enumerate() {
            h = client
                .forward(peer, s, u64::MAX / 2, 0, &h)
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
