//! `shoal bench allreduce`: one butterfly all-reduce among N real peers in this process,
//! every connection behind the link emulator if asked, timed against its bandwidth bound.
//!
//! The exchange is the one the averager runs, on its own bench protocol: the flat vector
//! is cut into one part per peer ([`crate::averaging::reduce::partition`]); peer i sends
//! part j, encoded with the codec, to peer j; peer j reduces its part
//! ([`crate::averaging::reduce::reduce_part`]) and sends the result to every other peer.
//! Left out: the averager's round protocol (leader, member list, retries), which adds a
//! round trip. The bound is `2·(N−1)/N · bytes ÷ bandwidth` with `bytes` the encoded size
//! of the whole vector and `bandwidth` the slower direction of the link; the error is the
//! result against the exact mean computed in f64.

use crate::averaging::reduce::{partition, reduce_part};
use crate::bench::codec::normal_data;
use crate::net::link::LinkSpec;
use crate::net::{io as netio, NetError, NetHandle};
use crate::wire::{self, CodecSpec, Limits, TensorData};
use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use libp2p::{PeerId, StreamProtocol};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

const PROTOCOL: StreamProtocol = StreamProtocol::new("/shoal/bench/allreduce/1.0.0");

/// Knobs of the all-reduce benchmark.
#[derive(Debug, Clone)]
pub struct AllreduceConfig {
    /// Peers taking part.
    pub peers: usize,
    /// Floats in the vector.
    pub floats: usize,
    /// Codec of the parts.
    pub codec: CodecSpec,
    /// Emulated link of every peer.
    pub link: Option<LinkSpec>,
    /// Timed repetitions (the median is reported).
    pub reps: usize,
}

/// What it measured.
#[derive(Debug, Clone)]
pub struct AllreduceReport {
    /// Median seconds of one all-reduce (every peer holds the result).
    pub median_s: f64,
    /// Fastest.
    pub best_s: f64,
    /// Bound in seconds, when the link has a bandwidth.
    pub bound_s: Option<f64>,
    /// Encoded bytes of the whole vector in the codec.
    pub vector_bytes: usize,
    /// Largest absolute error of any peer's result against the exact mean.
    pub max_abs_err: f64,
    /// RMS error over RMS of the exact mean.
    pub rel_rms_err: f64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Head {
    /// 0: a part to reduce; 1: a reduced part.
    phase: u8,
    part: u32,
    rep: u32,
    from: u32,
}

type Inbox = mpsc::Receiver<(Head, Vec<f32>)>;

fn decode(frame: &[u8]) -> Option<Vec<f32>> {
    match wire::decode(frame, &Limits::default()).ok()?.data {
        TensorData::F32(v) => Some(v),
        TensorData::U32(_) => None,
    }
}

async fn send(
    net: &NetHandle,
    to: PeerId,
    head: &Head,
    values: &[f32],
    codec: &CodecSpec,
) -> Result<(), NetError> {
    let mut frame = Vec::new();
    wire::encode_f32(&[values.len()], values, codec, &mut frame)
        .map_err(|e| NetError::Invalid(e.to_string()))?;
    // Every stream is answered (the receiver's lane holds far more than a round's
    // messages), so one try: a failure is the connection's, and the benchmark reports it.
    let once = async {
        let mut s = net.open_stream(to, PROTOCOL).await?;
        let io = |e: String| NetError::Stream {
            peer: to.to_string(),
            cause: e,
        };
        netio::write_message(&mut s, head, &[&frame])
            .await
            .map_err(|e| io(e.to_string()))?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack)
            .await
            .map_err(|e| io(e.to_string()))?;
        let _ = s.close().await;
        Ok::<_, NetError>(())
    };
    match tokio::time::timeout(Duration::from_secs(60), once).await {
        Ok(r) => r,
        Err(_) => Err(NetError::Invalid(format!(
            "sending a part to {to}: no acknowledgement within 60 s"
        ))),
    }
}

/// The next message in `inbox`; an error, not a hang, when none comes within a minute
/// (a peer whose sends all failed).
async fn recv(inbox: &mut Inbox) -> Result<(Head, Vec<f32>), NetError> {
    match tokio::time::timeout(Duration::from_secs(60), inbox.recv()).await {
        Ok(Some(m)) => Ok(m),
        Ok(None) => Err(NetError::Invalid("inbox closed".into())),
        Err(_) => Err(NetError::Invalid(
            "no part arrived within 60 s; a peer could not send".into(),
        )),
    }
}

/// Sends `what(j)` to every peer `j` but `me`, all at once; the first error, if any.
async fn send_to_others<'a>(
    net: &NetHandle,
    ids: &[PeerId],
    me: usize,
    codec: &CodecSpec,
    what: impl Fn(usize) -> (Head, &'a [f32]),
) -> Result<(), NetError> {
    let sends = (0..ids.len()).filter(|&j| j != me).map(|j| {
        let (head, values) = what(j);
        async move { send(net, ids[j], &head, values, codec).await }
    });
    futures::future::join_all(sends).await.into_iter().collect()
}

/// One peer's part in repetition `rep`: returns the full reduced vector.
async fn allreduce_once(
    me: usize,
    nets: &[NetHandle],
    ids: &[PeerId],
    inbox: &mut Inbox,
    data: &[f32],
    cfg: &AllreduceConfig,
    rep: u32,
) -> Result<Vec<f32>, NetError> {
    let n = nets.len();
    let parts = partition(data.len(), n);
    let net = &nets[me];
    let sent = send_to_others(net, ids, me, &cfg.codec, |j| {
        let head = Head {
            phase: 0,
            part: j as u32,
            rep,
            from: me as u32,
        };
        (head, &data[parts[j].clone()])
    });
    // Gather the others' copies of my part while sending mine.
    let gather = async {
        // Keyed by sender.
        let mut got: std::collections::BTreeMap<u32, Vec<f32>> = Default::default();
        let mut reduced: Vec<Option<Vec<f32>>> = vec![None; n];
        while got.len() < n - 1 {
            let (h, v) = recv(inbox).await?;
            if h.rep != rep {
                continue;
            }
            match h.phase {
                0 => {
                    got.insert(h.from, v);
                }
                _ => reduced[h.part as usize] = Some(v),
            }
        }
        Ok((got, reduced))
    };
    let (sent, gathered) = tokio::join!(sent, gather);
    sent?;
    let (got, mut reduced) = gathered?;
    let mine = &data[parts[me].clone()];
    let mut sums: Vec<(&[f32], u64)> = vec![(mine, 1)];
    sums.extend(got.values().map(|v| (v.as_slice(), 1u64)));
    let (part, _) = reduce_part(&sums, parts[me].len());
    let head = |_| Head {
        phase: 1,
        part: me as u32,
        rep,
        from: me as u32,
    };
    let sent = send_to_others(net, ids, me, &cfg.codec, |j| (head(j), part.as_slice()));
    let gather = async {
        while reduced
            .iter()
            .enumerate()
            .any(|(j, r)| j != me && r.is_none())
        {
            let (h, v) = recv(inbox).await?;
            if h.rep == rep && h.phase == 1 {
                reduced[h.part as usize] = Some(v);
            }
        }
        Ok(())
    };
    let (sent, gathered) = tokio::join!(sent, gather);
    sent?;
    gathered?;
    let mut out = Vec::with_capacity(data.len());
    for (j, r) in reduced.into_iter().enumerate() {
        if j == me {
            out.extend_from_slice(&part);
        } else {
            out.extend(r.unwrap_or_default());
        }
    }
    Ok(out)
}

/// Runs the benchmark on the current tokio runtime.
pub async fn run(cfg: &AllreduceConfig) -> Result<AllreduceReport, NetError> {
    if cfg.peers < 2 || cfg.floats < cfg.peers {
        return Err(NetError::Invalid(
            "--peers must be at least 2 and --floats at least --peers".into(),
        ));
    }
    let mut nets = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..cfg.peers {
        let h = super::bench_node(Some("/ip4/127.0.0.1/tcp/0"), cfg.link)?;
        addrs.push(super::first_addr(&h, "a peer").await?);
        nets.push(h);
    }
    let ids: Vec<PeerId> = nets.iter().map(|h| h.local_peer_id()).collect();
    // Connect every pair up front, one dial at a time: streams opened while two peers
    // dial each other at once were seen to hang.
    for (i, h) in nets.iter().enumerate() {
        for (id, a) in ids.iter().zip(&addrs) {
            if *id != h.local_peer_id() {
                h.add_addresses(*id, vec![a.clone()]).await?;
            }
        }
        for a in addrs.iter().skip(i + 1) {
            h.dial(a.clone()).await?;
        }
    }
    // Every peer's inbound streams go to its inbox.
    let mut inboxes = Vec::new();
    let mut servers = Vec::new();
    for h in &nets {
        let (tx, rx) = mpsc::channel(4 * cfg.peers);
        let mut incoming = h.accept(PROTOCOL)?;
        servers.push(tokio::spawn(async move {
            while let Some((_, mut s)) = incoming.next().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let Ok(head) = netio::read_header(&mut s).await else {
                        return;
                    };
                    let Ok(head) = serde_json::from_slice::<Head>(&head) else {
                        return;
                    };
                    let Ok(frame) = netio::read_frame(&mut s, &Limits::default()).await else {
                        return;
                    };
                    if let Some(v) = decode(&frame) {
                        let _ = s.write_all(&[1]).await;
                        let _ = s.close().await;
                        let _ = tx.send((head, v)).await;
                    }
                });
            }
        }));
        inboxes.push(rx);
    }
    let data: Vec<Arc<Vec<f32>>> = (0..cfg.peers)
        .map(|i| Arc::new(normal_data(cfg.floats, 100 + i as u64)))
        .collect();
    let exact: Vec<f64> = (0..cfg.floats)
        .map(|k| data.iter().map(|d| d[k] as f64).sum::<f64>() / cfg.peers as f64)
        .collect();
    let nets = Arc::new(nets);
    let ids = Arc::new(ids);
    let mut times = Vec::new();
    let (mut max_abs, mut rel) = (0.0f64, 0.0f64);
    let mut inboxes: Vec<Option<Inbox>> = inboxes.into_iter().map(Some).collect();
    // One untimed warm-up (connections), then the timed repetitions.
    for rep in 0..=cfg.reps.max(1) as u32 {
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for (me, slot) in inboxes.iter_mut().enumerate() {
            let mut inbox = slot
                .take()
                .ok_or_else(|| NetError::Invalid("inbox in use".into()))?;
            let (nets, ids, d, c) = (
                Arc::clone(&nets),
                Arc::clone(&ids),
                Arc::clone(&data[me]),
                cfg.clone(),
            );
            tasks.push(tokio::spawn(async move {
                let r = allreduce_once(me, &nets, &ids, &mut inbox, &d, &c, rep).await;
                (r, inbox)
            }));
        }
        let mut results = Vec::new();
        for (me, t) in tasks.into_iter().enumerate() {
            let (r, inbox) = t
                .await
                .map_err(|e| NetError::Invalid(format!("all-reduce task failed: {e}")))?;
            inboxes[me] = Some(inbox);
            results.push(r?);
        }
        let secs = t0.elapsed().as_secs_f64();
        if rep > 0 {
            times.push(secs);
        }
        let norm = (exact.iter().map(|x| x * x).sum::<f64>() / exact.len() as f64).sqrt();
        for r in &results {
            let mut sq = 0.0;
            for (a, b) in r.iter().zip(&exact) {
                let e = (*a as f64 - b).abs();
                max_abs = max_abs.max(e);
                sq += e * e;
            }
            rel = rel.max((sq / exact.len() as f64).sqrt() / norm.max(1e-30));
        }
    }
    for s in servers {
        s.abort();
    }
    for h in nets.iter() {
        h.shutdown().await;
    }
    times.sort_by(f64::total_cmp);
    let mut frame = Vec::new();
    wire::encode_f32(&[data[0].len()], &data[0], &cfg.codec, &mut frame)
        .map_err(|e| NetError::Invalid(e.to_string()))?;
    let bw = cfg.link.and_then(|l| match (l.up, l.down) {
        (Some(u), Some(d)) => Some(u.min(d)),
        (Some(x), None) | (None, Some(x)) => Some(x),
        (None, None) => None,
    });
    let n = cfg.peers as f64;
    Ok(AllreduceReport {
        median_s: times[times.len() / 2],
        best_s: times[0],
        bound_s: bw.map(|b| 2.0 * (n - 1.0) / n * frame.len() as f64 / b),
        vector_bytes: frame.len(),
        max_abs_err: max_abs,
        rel_rms_err: rel,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn three_peers_reduce_to_the_mean() {
        let cfg = AllreduceConfig {
            peers: 3,
            floats: 10_001,
            codec: CodecSpec::F32,
            link: None,
            reps: 1,
        };
        let r = run(&cfg).await.unwrap();
        // f32 parts: only the f32 rounding of the mean.
        assert!(r.max_abs_err < 1e-5, "{r:?}");
        let cfg = AllreduceConfig {
            codec: CodecSpec::INT8,
            link: Some(LinkSpec::parse("bw=400mbit,rtt=2ms").unwrap()),
            ..cfg
        };
        let r = run(&cfg).await.unwrap();
        // int8 blocks of N(0,1): about 1% relative error, far from none and far from 100%.
        assert!(r.rel_rms_err > 1e-4 && r.rel_rms_err < 0.05, "{r:?}");
        let bound = r.bound_s.unwrap();
        assert!(bound > 0.0 && r.median_s >= bound * 0.5, "{r:?}");
        assert!(run(&AllreduceConfig { peers: 1, ..cfg }).await.is_err());
    }
}
