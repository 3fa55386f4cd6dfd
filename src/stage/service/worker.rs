//! The compute side of a stage service: a bounded job queue and the one OS thread that owns
//! the candle stage and works through it; and the start-up throughput measurement.

use super::conn::{ok, refusal};
use super::jobs::Lane;
use super::{ReplicaStatus, Reply, Shared};
use crate::model::{ModelError, Stage, Upstream};
use crate::stage::replica::Replica;
use crate::stage::tensor;
use crate::wire::msg::{ErrorKind, Op, Request};
use crate::wire::CodecSpec;
use candle_core::{DType, Tensor};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// A forward or backward call waiting for the compute thread.
pub(super) struct Job {
    req: Request,
    frames: Vec<Vec<u8>>,
    reply: oneshot::Sender<Reply>,
    queued_at: Instant,
}

pub(super) async fn queue_job(shared: &Arc<Shared>, req: Request, frames: Vec<Vec<u8>>) -> Reply {
    let (tx, rx) = oneshot::channel();
    if shared.jobs.is_closed() {
        return refusal(shared, ErrorKind::Overloaded, "this replica is stopping");
    }
    let lane = Lane::of(req.op());
    shared.queue.fetch_add(1, Ordering::Relaxed);
    let job = Job {
        req,
        frames,
        reply: tx,
        queued_at: Instant::now(),
    };
    if shared.jobs.push(lane, job).is_err() {
        shared.queue.fetch_sub(1, Ordering::Relaxed);
        return refusal(shared, ErrorKind::Overloaded, "request queue is full");
    }
    match rx.await {
        Ok(reply) => reply,
        Err(_) => refusal(shared, ErrorKind::Internal, "the compute thread stopped"),
    }
}

/// Runs the compute thread's loop; a panic in it is caught and recorded as the service's
/// failure ([`super::StageService::failure`]): the replica refuses everything from then on
/// (it drains), and whoever runs it withdraws it and stops.
pub(super) fn run_guarded(shared: &Arc<Shared>, body: impl FnOnce()) {
    if let Err(why) = guarded(body) {
        tracing::debug!(stage = shared.stage, "the compute thread failed: {why}");
        shared.draining.store(true, Ordering::Relaxed);
        *shared.failed.lock() = Some(why);
        shared.jobs.abandon();
    }
}

/// Runs `body`, catching a panic: its message's first line.
fn guarded(body: impl FnOnce()) -> Result<(), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).map_err(|p| {
        p.downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or("a panic")
            .lines()
            .next()
            .unwrap_or("")
            .to_string()
    })
}

/// The compute thread's state.
pub(super) struct Worker {
    codec: CodecSpec,
    shared: Arc<Shared>,
}

enum Fail {
    Refuse(ErrorKind, String),
}

impl From<ModelError> for Fail {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::BadInput(m) => Fail::Refuse(ErrorKind::BadTensor, m),
            other => Fail::Refuse(ErrorKind::Internal, other.to_string()),
        }
    }
}

impl From<crate::stage::replica::SyncError> for Fail {
    fn from(e: crate::stage::replica::SyncError) -> Self {
        match e {
            crate::stage::replica::SyncError::Closed(m) => Fail::Refuse(ErrorKind::StepClosed, m),
            crate::stage::replica::SyncError::Model(m) => m.into(),
        }
    }
}

impl From<candle_core::Error> for Fail {
    fn from(e: candle_core::Error) -> Self {
        Fail::Refuse(ErrorKind::Internal, e.to_string())
    }
}

impl Worker {
    pub(super) fn new(codec: CodecSpec, shared: Arc<Shared>) -> Self {
        Self { codec, shared }
    }

    pub(super) fn run(self) {
        let c = &self.shared.counters;
        let codec_us = || c.decode_us.load(Ordering::Relaxed) + c.encode_us.load(Ordering::Relaxed);
        while let Some(job) = self.shared.jobs.pop() {
            let t0 = Instant::now();
            let waited = t0.saturating_duration_since(job.queued_at);
            c.queue_us
                .fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
            c.jobs.fetch_add(1, Ordering::Relaxed);
            let before = codec_us();
            // Read only where the job line is logged: two file reads per job otherwise.
            let logged = tracing::enabled!(tracing::Level::DEBUG);
            let sched0 = if logged { sched_ns() } else { (0, 0) };
            let result = self.process(&job.req, &job.frames);
            let us = (t0.elapsed().as_micros() as u64).saturating_sub(codec_us() - before);
            c.compute_us.fetch_add(us, Ordering::Relaxed);
            if logged {
                let sched1 = sched_ns();
                tracing::debug!(
                    cpu_ms = (sched1.0.saturating_sub(sched0.0)) / 1_000_000,
                    runq_ms = (sched1.1.saturating_sub(sched0.1)) / 1_000_000,
                    op = ?job.req.op(),
                    mb = job.req.call.mb(),
                    step = job.req.step,
                    wait_ms = waited.as_millis() as u64,
                    ms = us / 1000,
                    "job"
                );
            }
            self.shared.queue.fetch_sub(1, Ordering::Relaxed);
            let reply = match result {
                Ok(r) => {
                    self.shared.counters.served.fetch_add(1, Ordering::Relaxed);
                    r
                }
                Err(Fail::Refuse(kind, m)) => refusal(&self.shared, kind, m),
            };
            let _ = job.reply.send(reply);
        }
    }

    fn input(&self, r: &Replica, bytes: &[u8], what: &str) -> Result<Tensor, Fail> {
        let stage = r.stage();
        let t0 = Instant::now();
        let d = tensor::decode(bytes, &self.shared.cfg.limits, stage.device());
        self.shared
            .counters
            .decode_us
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        let d = d.map_err(|e| Fail::Refuse(ErrorKind::BadTensor, format!("{what}: {e}")))?;
        if !d.finite {
            return Err(Fail::Refuse(
                ErrorKind::NonFinite,
                format!("{what} holds NaN or infinite values"),
            ));
        }
        let t = d.tensor;
        if t.dtype() == DType::F32 && stage.dtype() != DType::F32 {
            Ok(t.to_dtype(stage.dtype())?)
        } else {
            Ok(t)
        }
    }

    fn encode(&self, t: &Tensor) -> Result<Vec<u8>, Fail> {
        self.encode_as(t, &self.codec)
    }

    fn encode_as(&self, t: &Tensor, codec: &CodecSpec) -> Result<Vec<u8>, Fail> {
        let t0 = Instant::now();
        let r = tensor::encode(t, codec);
        self.shared
            .counters
            .encode_us
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        r.map_err(|e| Fail::Refuse(ErrorKind::Internal, e.to_string()))
    }

    fn process(&self, req: &Request, frames: &[Vec<u8>]) -> Result<Reply, Fail> {
        // Unit tests only: the way to make this thread panic on demand.
        #[cfg(test)]
        if req.call.mb() == tests::PANIC_MB {
            panic!("asked to panic by a test");
        }
        let mut r = self.shared.replica.blocking_lock();
        let input = self.input(&r, &frames[0], "input")?;
        let job = req.job();
        match req.op() {
            Op::Forward => {
                // A probe's forward keeps nothing (microbatch 0 is never kept).
                let sync = job.sync && !job.dry;
                let (out, at) = if sync {
                    r.forward_sync(&input, job.mb, req.step)?
                } else {
                    (r.forward(&input, if job.dry { 0 } else { job.mb })?, 0)
                };
                let last = r.stage().is_last();
                drop(r);
                // Logits carry no id column, whatever the boundaries do.
                let frame = match last {
                    true => self.encode_as(
                        &out,
                        &CodecSpec {
                            ids_last: false,
                            ..self.codec
                        },
                    )?,
                    false => self.encode(&out)?,
                };
                let mut header = ok(&self.shared, 1);
                if sync {
                    // The step the microbatch was computed at here (assigned on stage 0).
                    header.step = at;
                }
                Ok(Reply {
                    header,
                    frames: vec![frame],
                })
            }
            Op::Backward => {
                let up = self.input(&r, &frames[1], "upstream")?;
                let upstream = if r.stage().is_last() {
                    Upstream::Targets(&up)
                } else {
                    Upstream::Grad(&up)
                };
                let sync = job.sync && !job.dry;
                let (g, fresh, at) = if job.dry {
                    (r.probe_backward(&input, upstream)?, false, 0)
                } else if sync {
                    match r.backward_sync(&input, upstream, job.mb, req.step) {
                        Ok(v) => v,
                        Err(e) => {
                            *self.shared.status.lock() = ReplicaStatus::of(&r);
                            return Err(e.into());
                        }
                    }
                } else {
                    let (g, fresh) = r.backward(&input, upstream, job.mb)?;
                    (g, fresh, 0)
                };
                // Written while the replica is still locked: a status taken here and
                // stored after the averager applied a step would put the step back.
                let status = ReplicaStatus::of(&r);
                *self.shared.status.lock() = status;
                drop(r);
                if fresh {
                    let samples = input.dims().first().copied().unwrap_or(0) as u64;
                    self.shared
                        .counters
                        .samples_accumulated
                        .fetch_add(samples, Ordering::Relaxed);
                }
                self.shared.progress.notify_one();
                self.shared.sync_changed.notify_waiters();
                let frames = match &g.grad_input {
                    Some(t) => vec![self.encode(t)?],
                    None => Vec::new(),
                };
                let mut header = ok(&self.shared, frames.len() as u8);
                header.loss = g.loss;
                if sync {
                    header.step = at;
                }
                Ok(Reply { header, frames })
            }
            _ => Err(Fail::Refuse(
                ErrorKind::BadRequest,
                "only forward and backward are queued".into(),
            )),
        }
    }
}

/// This thread's time on a CPU and waiting for one, in ns (Linux's schedstat; zeros where
/// it cannot be read): says whether a slow job worked or waited.
fn sched_ns() -> (u64, u64) {
    let Ok(s) = std::fs::read_to_string("/proc/thread-self/schedstat") else {
        return (0, 0);
    };
    let mut it = s.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

/// Samples per second of forward + backward of `stage` on microbatches of `batch`, as a
/// replica serves them (the backward through the forward's kept graph), measured over at
/// least `min_iters` runs or `budget`, after two warm-up runs (the first allocations'
/// page faults are not the stage's speed).
pub fn measure_throughput(
    stage: &Stage,
    batch: usize,
    seq_len: usize,
    min_iters: usize,
    budget: Duration,
) -> Result<f64, ModelError> {
    let input = stage.example_input(batch, seq_len)?;
    let up = stage.example_upstream(batch, seq_len)?;
    let once = || -> Result<(), ModelError> {
        let kept = stage.forward_kept(&input)?;
        let upstream = if stage.is_last() {
            Upstream::Targets(&up)
        } else {
            Upstream::Grad(&up)
        };
        stage.backward_kept(kept, upstream)?;
        Ok(())
    };
    once()?;
    once()?;
    let t0 = Instant::now();
    let mut n = 0usize;
    while n < min_iters.max(1) || (t0.elapsed() < budget && n < 1000) {
        once()?;
        n += 1;
    }
    let secs = t0.elapsed().as_secs_f64().max(1e-9);
    Ok((n * batch) as f64 / secs)
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        reason = "tests fail by panicking"
    )]
    use crate::config::RunConfig;
    use crate::dht::Manifest;
    use crate::model::Stage;
    use crate::net::{self, NetConfig};
    use crate::stage::client::StageClient;
    use crate::stage::replica::Replica;
    use crate::stage::service::{ServiceConfig, StageService};
    use crate::wire::msg::ErrorKind;
    use crate::wire::CodecSpec;
    use candle_core::{DType, Device, Tensor};
    use std::sync::Arc;
    use std::time::Duration;

    /// A microbatch id that makes the compute thread panic (unit tests only).
    pub(super) const PANIC_MB: u64 = u64::MAX - 7;

    /// The real compute thread panics on a job: the call in flight is answered, the
    /// service records why, drains, and refuses what comes next.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_compute_thread_that_panics_fails_the_service_and_it_refuses_calls() {
        let mut cfg = RunConfig::tiny();
        cfg.stages.count = 2;
        cfg.stages.cuts.clear();
        cfg.validate().unwrap();
        let m = Manifest::from_config(&cfg).unwrap();
        let stage = Stage::new(&cfg, 0, &Device::Cpu).unwrap();
        let replica = Arc::new(tokio::sync::Mutex::new(Replica::new(&cfg, stage).unwrap()));
        let listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
        let server = net::start(NetConfig::new(
            libp2p::identity::Keypair::generate_ed25519(),
            listen,
        ))
        .unwrap();
        let svc = StageService::start(&server, &m, replica, ServiceConfig::default()).unwrap();
        let addr = server
            .wait_listening(1, Duration::from_secs(5))
            .await
            .unwrap()[0]
            .clone();
        let c = net::start(NetConfig::new(
            libp2p::identity::Keypair::generate_ed25519(),
            vec![],
        ))
        .unwrap();
        let pid = c.dial(addr).await.unwrap();
        let sc = StageClient::new(c, m.id.clone(), CodecSpec::F32);
        let x = Tensor::zeros(
            (cfg.training.batch_size, cfg.model.seq_len),
            DType::U32,
            &Device::Cpu,
        )
        .unwrap();
        assert!(sc.forward(pid, 0, 0, 1, &x).await.is_ok());
        assert_eq!(svc.failure(), None);
        let e = sc.forward(pid, 0, 0, PANIC_MB, &x).await.unwrap_err();
        assert_eq!(e.kind(), Some(ErrorKind::Internal), "{e}");
        // The call's answer goes out while the thread unwinds; the failure is recorded
        // once the unwinding is caught, a moment later.
        for _ in 0..100 {
            if svc.failure().is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(svc.failure().as_deref(), Some("asked to panic by a test"));
        assert!(svc.is_draining());
        let e = sc.forward(pid, 0, 0, 2, &x).await.unwrap_err();
        assert!(e.kind().is_some(), "refused, not dropped: {e}");
    }

    #[test]
    fn a_panic_in_the_compute_loop_is_caught_with_its_first_line() {
        assert_eq!(super::guarded(|| {}), Ok(()));
        let e = super::guarded(|| panic!("candle blew up\nsecond line"));
        assert_eq!(e, Err("candle blew up".to_string()));
        let n = 3;
        let e = super::guarded(move || panic!("index {n} out of range"));
        assert_eq!(e, Err("index 3 out of range".to_string()));
    }
}
