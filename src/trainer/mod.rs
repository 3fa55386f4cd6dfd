//! Trainer loops: read data, drive microbatches through one replica per stage, retry on
//! another replica when one fails, and account for every sample.
//!
//! - [`routing`]: the pure choice of a replica (stochastic wiring); `refresh`: the
//!   replicas and their steps, re-read from the DHT.
//! - this module: the loop. For each microbatch: forward stage by stage (keeping every
//!   stage's input), backward from the last stage with the targets, then back through the
//!   same replicas. A replica that errs or times out is banned for a while and the stage is
//!   repeated on another replica of the same stage from the kept input (swap-in); backward
//!   recomputes the forward, so any replica can take over. A microbatch fails only when a
//!   stage has had no usable replica for `stage_deadline`; it is then counted as failed with
//!   its reason. Invariant: fed = completed + failed once the loop has stopped.

mod call;
mod push;
mod refresh;
pub mod report;
pub mod routing;
mod stats;
mod window;
pub use routing::Routing;
pub use stats::TrainerStats;

use crate::data::{DataError, Sampler, TokenSource};
use crate::dht::Manifest;
use crate::net::NetHandle;
use crate::rng::{derive_seed, Rng};
use crate::stage::client::StageClient;
use call::{call_stage, Failure};
use candle_core::{Device, Tensor};
use libp2p::PeerId;
use parking_lot::Mutex;
use routing::ReplicaState;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{watch, Semaphore};
use tracing::Instrument;

/// Knobs of a trainer loop.
#[derive(Debug, Clone)]
pub struct TrainerConfig {
    /// Which data stream this trainer reads (distinct per trainer).
    pub index: u64,
    /// Microbatches in flight at once (without `sync_steps`, a microbatch's place is taken
    /// by the next as its last backward goes out; with it, at least one per stage and a
    /// step's worth).
    pub concurrency: usize,
    /// Per-call timeout.
    pub call_timeout: Duration,
    /// How long a failed replica is avoided.
    pub ban: Duration,
    /// A microbatch fails when a stage has no usable replica for this long.
    pub stage_deadline: Duration,
    /// How often replicas are re-read from the DHT.
    pub refresh: Duration,
    /// Stop after this many microbatches (default: when the run reaches its last step).
    pub max_microbatches: Option<u64>,
    /// Synchronous steps: every gradient of step s computed at parameters s. In a pipeline,
    /// stage 0 assigns each microbatch its step and holds it until a step has room
    /// ([`crate::stage::sync`]), and the trainer keeps enough microbatches in flight to keep
    /// every stage busy; with one stage, the trainer waits after each microbatch until the
    /// stage applied the step it went into.
    pub sync_steps: bool,
    /// How replicas are picked.
    pub routing: Routing,
    /// Have the stage before the last push its output straight to the last stage's
    /// replica (one link and one one-way latency fewer per microbatch) instead of sending
    /// it back through this trainer.
    pub push: bool,
    /// This trainer's copy of the run's prepared data (the run's manifest names the
    /// creator's folder); refused unless tokenized with the run's tokenizer.
    pub data: Option<std::path::PathBuf>,
}

impl TrainerConfig {
    /// Per-call timeout by default (`--call-timeout`).
    pub const CALL_TIMEOUT: Duration = Duration::from_secs(20);
    /// Microbatches in flight per loop by default (`--concurrency`).
    pub const CONCURRENCY: usize = 1;
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            index: 0,
            concurrency: Self::CONCURRENCY,
            call_timeout: Self::CALL_TIMEOUT,
            ban: Duration::from_secs(5),
            stage_deadline: Duration::from_secs(30),
            refresh: Duration::from_secs(1),
            max_microbatches: None,
            sync_steps: true,
            routing: Routing::Wiring,
            push: true,
            data: None,
        }
    }
}

/// Why a trainer could not start.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    /// The data source did not open.
    #[error(transparent)]
    Data(#[from] DataError),
}

type Table = Vec<Vec<(PeerId, ReplicaState)>>;

struct Ctx {
    cfg: TrainerConfig,
    client: StageClient,
    stages: usize,
    total_steps: u64,
    table: Mutex<Table>,
    stats: Arc<TrainerStats>,
    rng: Mutex<Rng>,
    /// Per stage: the next turn of round-robin routing.
    turns: Vec<std::sync::atomic::AtomicUsize>,
    /// Announcements read lately ([`refresh`]).
    anns: crate::stage::registry::AnnCache,
    /// Whether the last refresh found replicas the table did not hold.
    grew: std::sync::atomic::AtomicBool,
    /// Microbatches that may be in flight now.
    window: window::Window,
}

/// How long a trainer reuses a replica's announcement before reading it again (kept past
/// its expiry: the replica is still a provider, and calls tell if it answers): only its
/// throughput, queue, step and ban notes age, and the trainer measures the first two. Each
/// read is a DHT walk: at 60 s, 20 trainers of 200 peers were ~250 walks a second.
const ANNOUNCEMENT_MAX_AGE: Duration = Duration::from_secs(180);

/// How long a trainer waits before looking again for a replica whose announcement was not
/// found (its record may not have spread yet).
const ANNOUNCEMENT_MISSING: Duration = Duration::from_secs(60);

/// A running trainer loop.
pub struct Trainer {
    stats: Arc<TrainerStats>,
    client: StageClient,
    stop: watch::Sender<bool>,
    /// The loop, in `tasks`: it ends with its microbatches after `stop`, or is cancelled.
    task: tokio::task::JoinHandle<Option<()>>,
    tasks: crate::tasks::Tasks,
    /// Cancels the loop when the trainer is dropped without being stopped.
    _cancel: tokio_util::sync::DropGuard,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer").finish()
    }
}

impl Trainer {
    /// Starts a trainer loop for the run.
    pub fn spawn(net: NetHandle, m: &Manifest, cfg: TrainerConfig) -> Result<Self, TrainerError> {
        let source = match &cfg.data {
            None => TokenSource::open(&m.config)?,
            Some(dir) => {
                let mut run = m.config.clone();
                match &mut run.data {
                    crate::config::DataConfig::Prepared { path, .. } => *path = dir.clone(),
                    _ => {
                        return Err(DataError::Prepare(format!(
                            "the run does not train on prepared data, so --data {} cannot \
                             replace its data (make the run with `shoal run new CONFIG --data DIR`)",
                            dir.display()
                        ))
                        .into())
                    }
                }
                TokenSource::open(&run)?
            }
        };
        let stages = m.config.stages.count;
        let client = StageClient::new(net, m.id.clone(), m.config.codecs.activations.wire())
            .with_timeout(cfg.call_timeout)
            .with_sync(cfg.sync_steps && stages > 1);
        let stats = Arc::new(TrainerStats::new(stages));
        let seed = derive_seed(m.config.training.data_seed, &format!("route/{}", cfg.index));
        let ctx = Arc::new(Ctx {
            window: window::Window::of(&cfg, stages, &m.config),
            cfg,
            client: client.clone(),
            stages,
            total_steps: m.config.training.steps,
            table: Mutex::new(vec![Vec::new(); stages]),
            anns: crate::stage::registry::AnnCache::new(ANNOUNCEMENT_MAX_AGE)
                .missing_for(ANNOUNCEMENT_MISSING)
                .past_expiry(),
            grew: std::sync::atomic::AtomicBool::new(false),
            stats: Arc::clone(&stats),
            rng: Mutex::new(Rng::new(seed ^ u64::from(std::process::id()))),
            turns: (0..stages)
                .map(|_| std::sync::atomic::AtomicUsize::new(0))
                .collect(),
        });
        let (stop, stop_rx) = watch::channel(false);
        let batch = m.config.training.batch_size;
        let seq = m.config.model.seq_len;
        let data_seed = m.config.training.data_seed;
        let tasks = crate::tasks::Tasks::new();
        let task = tasks.spawn(run(ctx, source, batch, seq, data_seed, stop_rx));
        Ok(Self {
            stats,
            client,
            stop,
            task,
            _cancel: tasks.cancel_on_drop(),
            tasks,
        })
    }

    /// What it counted so far.
    pub fn stats(&self) -> &Arc<TrainerStats> {
        &self.stats
    }

    /// Bytes its calls moved.
    pub fn client(&self) -> &StageClient {
        &self.client
    }

    /// Whether the loop has ended (run finished or stopped).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops starting microbatches and waits for those in flight.
    /// Microbatches still waiting after `grace` (a stage with no replica, say) are
    /// abandoned and counted as failed with the reason "stopped".
    pub async fn stop(self) -> Arc<TrainerStats> {
        self.stop_within(Duration::from_secs(10)).await
    }

    /// [`Trainer::stop`] with a chosen grace period.
    pub async fn stop_within(self, grace: Duration) -> Arc<TrainerStats> {
        let _ = self.stop.send(true);
        let mut task = self.task;
        if tokio::time::timeout(grace, &mut task).await.is_err() {
            self.tasks.shutdown(Duration::from_secs(5)).await;
            let s = &self.stats;
            let open = s.fed.load(Ordering::Relaxed).saturating_sub(
                s.completed.load(Ordering::Relaxed) + s.failed.load(Ordering::Relaxed),
            );
            s.failed.fetch_add(open, Ordering::Relaxed);
            {
                let mut f = s.failures.lock();
                *f.entry("stopped before the microbatch finished".into())
                    .or_default() += open;
            }
        }
        self.stats
    }

    /// Waits for the loop to end on its own.
    pub async fn wait(self) -> Arc<TrainerStats> {
        let _ = self.task.await;
        self.stats
    }
}

async fn run(
    ctx: Arc<Ctx>,
    source: TokenSource,
    batch: usize,
    seq: usize,
    data_seed: u64,
    mut stop: watch::Receiver<bool>,
) {
    // The replicas and their steps before the first microbatch.
    refresh::refresh(&ctx).await;
    // In a set, so that it ends with this loop also when the loop is aborted
    // ([`Trainer::stop_within`]): a dropped `JoinSet` aborts its tasks, a dropped
    // `JoinHandle` would leave it querying the DHT for ever.
    let mut refresher = tokio::task::JoinSet::new();
    {
        let ctx = Arc::clone(&ctx);
        refresher.spawn(tracing::Instrument::in_current_span(async move {
            loop {
                tokio::time::sleep(refresh::period(&ctx)).await;
                refresh::refresh(&ctx).await;
            }
        }));
    }
    let mut sampler = Sampler::new(data_seed, ctx.cfg.index);
    let most = ctx.window.most();
    let sem = Arc::new(Semaphore::new(most));
    let mut tasks = tokio::task::JoinSet::new();
    let mut counter: u64 = 0;
    let tag = derive_seed(ctx.cfg.index, &ctx.client.local_peer_id().to_string()) << 24;
    loop {
        if *stop.borrow() || ctx.stats.min_stage_step() >= ctx.total_steps {
            break;
        }
        if ctx.cfg.max_microbatches.is_some_and(|m| counter >= m) {
            break;
        }
        let permit = tokio::select! {
            p = Arc::clone(&sem).acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            _ = stop.changed() => continue,
        };
        // Within the window (this permit counted): wait while more are in flight.
        while most - sem.available_permits() > ctx.window.limit() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let b = sampler.next_batch(&source, batch, seq);
        counter += 1;
        let mb = tag ^ counter;
        let ctx2 = Arc::clone(&ctx);
        while tasks.try_join_next().is_some() {}
        tasks.spawn(
            async move {
                microbatch(&ctx2, mb, b, permit).await;
            }
            .instrument(tracing::debug_span!("microbatch", id = mb)),
        );
    }
    // Every microbatch to its end (a permit may be given back before it).
    while tasks.join_next().await.is_some() {}
    refresher.abort_all();
}

fn fail(ctx: &Ctx, n: u64, reason: String) {
    ctx.stats.failed.fetch_add(n, Ordering::Relaxed);
    TrainerStats::bump(&ctx.stats.failures, &reason, n);
}

/// The backwards a microbatch owes the replicas that ran its forwards (see
/// [`ReplicaState::owed`]); whatever is still owed when it ends (failed or abandoned) is
/// settled on drop.
struct Owed<'a> {
    ctx: &'a Ctx,
    by_stage: Vec<Option<PeerId>>,
}

impl<'a> Owed<'a> {
    fn new(ctx: &'a Ctx) -> Self {
        Self {
            ctx,
            by_stage: vec![None; ctx.stages],
        }
    }

    fn add(&mut self, s: usize, peer: PeerId) {
        self.by_stage[s] = Some(peer);
        self.adjust(s, peer, true);
    }

    /// The backward of stage `s` is being sent: nothing is owed there any more. Returns
    /// the replica that ran its forward, if one did (the backward prefers it).
    fn settle(&mut self, s: usize) -> Option<PeerId> {
        let peer = self.by_stage[s].take()?;
        self.adjust(s, peer, false);
        Some(peer)
    }

    fn adjust(&self, s: usize, peer: PeerId, up: bool) {
        let mut table = self.ctx.table.lock();
        if let Some((_, st)) = table[s].iter_mut().find(|(p, _)| *p == peer) {
            st.owed = if up {
                st.owed + 1
            } else {
                st.owed.saturating_sub(1)
            };
        }
    }
}

impl Drop for Owed<'_> {
    fn drop(&mut self) {
        for s in 0..self.by_stage.len() {
            self.settle(s);
        }
    }
}

/// One microbatch as the stage calls see it: its id, the synchronous step it belongs to
/// (once stage 0 assigned one), its samples.
#[derive(Debug, Clone, Copy)]
pub(super) struct Micro {
    id: u64,
    tag: Option<u64>,
    n: u64,
}

/// Times a synchronous microbatch is started again after its step closed before it fails.
const MAX_RESTARTS: u64 = 16;

async fn microbatch(
    ctx: &Ctx,
    mb: u64,
    b: crate::data::Batch,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let mut permit = Some(permit);
    let n = b.batch as u64;
    ctx.stats.fed.fetch_add(n, Ordering::Relaxed);
    let shape = (b.batch, b.seq_len);
    let (x, y) = match (
        Tensor::from_vec(b.inputs, shape, &Device::Cpu),
        Tensor::from_vec(b.targets, shape, &Device::Cpu),
    ) {
        (Ok(x), Ok(y)) => (x, y),
        _ => return fail(ctx, n, "could not build the batch tensors".into()),
    };
    let mut id = mb;
    let mut restarts = 0;
    // The replica of stage 0 that admitted the last attempt: the next attempt goes there,
    // where what the last one still holds of its step is not counted against it (another
    // replica of stage 0 would count it, as the holder says, and could find no room).
    let mut admitted = None;
    loop {
        let micro = Micro { id, tag: None, n };
        match pass(ctx, micro, &x, &y, &mut permit, &mut admitted).await {
            Ok(stage0) => {
                ctx.stats.completed.fetch_add(n, Ordering::Relaxed);
                ctx.window.finished();
                if ctx.stages == 1 && ctx.cfg.sync_steps {
                    if let Some((peer, step)) = stage0 {
                        wait_for_step(ctx, peer, step).await;
                    }
                }
                return;
            }
            // Its step filled meanwhile: again, under a new id (a replica may have
            // accumulated the old one into the closed step) that stage 0 knows for the same
            // microbatch (what the old one held there is released), into the step open now.
            Err(Failure::Closed) if restarts < MAX_RESTARTS => {
                restarts += 1;
                ctx.stats.restarts.fetch_add(1, Ordering::Relaxed);
                id = crate::stage::sync::restarted_id(mb, restarts);
            }
            Err(Failure::Closed) => {
                return fail(
                    ctx,
                    n,
                    format!("its synchronous step closed {MAX_RESTARTS} times in a row"),
                )
            }
            Err(Failure::Failed(reason)) => return fail(ctx, n, reason),
        }
    }
}

/// With one stage, there is no stage 0 forward to hold a microbatch for its step: after
/// each microbatch, wait until the stage applied the step it went into.
async fn wait_for_step(ctx: &Ctx, peer: PeerId, step: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        match ctx.client.info(peer, 0).await {
            Ok(h) => {
                ctx.stats.stage_steps[0].fetch_max(h.step, Ordering::Relaxed);
                // Done, or the last step of the run will never come: stop waiting.
                if h.step > step || ctx.stats.min_stage_step() >= ctx.total_steps {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(_) => break,
        }
    }
}

/// The forwards and backwards of one microbatch; the replica of stage 0 that took its
/// backward, and the step it reported. `admitted`: the replica of stage 0 its forward
/// prefers, set to the one that admitted it.
async fn pass(
    ctx: &Ctx,
    mut micro: Micro,
    x: &Tensor,
    y: &Tensor,
    permit: &mut Option<tokio::sync::OwnedSemaphorePermit>,
    admitted: &mut Option<PeerId>,
) -> Result<Option<(PeerId, u64)>, Failure> {
    let (mb, n) = (micro.id, micro.n);
    // Synchronous microbatches of a pipeline carry their step (assigned by stage 0).
    let sync = ctx.cfg.sync_steps && ctx.stages > 1;
    let last = ctx.stages - 1;
    let mut inputs = vec![x.clone()];
    // Which replica ran each stage's forward, and the backward it is owed.
    let mut owed = Owed::new(ctx);
    // The last stage's answer when its input was pushed there.
    let mut pushed = None;
    // The step each stage computed the microbatch at (stage 0's: a stage that closed that
    // step refuses it).
    let mut tags: Vec<Option<u64>> = vec![None; ctx.stages];
    // The replica of stage 0 that admitted a synchronous microbatch: later stages go by
    // its lane ([`call::lane`]).
    let mut first: Option<PeerId> = None;
    let mut note = |s: usize, step: u64, micro: &mut Micro| {
        if sync {
            tags[s] = Some(step);
            micro.tag = Some(step);
        }
        ctx.stats.stage_steps[s].fetch_max(step, Ordering::Relaxed);
        ctx.stats.step.fetch_max(step, Ordering::Relaxed);
    };
    for s in 0..last {
        if s + 1 == last && ctx.cfg.push {
            let lane_of = if s == 0 { *admitted } else { first };
            let hop = push::into_last(ctx, s, micro, &inputs[s], y, &mut owed, lane_of).await;
            if s == 0 && sync {
                // The replica that ran stage 0's forward admitted it (or refused it).
                *admitted = owed.by_stage[0].or(*admitted);
            }
            match hop? {
                push::Hop::Done(peer, reply, step) => {
                    note(s, step, &mut micro);
                    pushed = Some((peer, reply));
                    break;
                }
                push::Hop::Plain(Some((out, step))) => {
                    note(s, step, &mut micro);
                    inputs.push(out);
                    continue;
                }
                // The forward runs again below, its output coming back this time.
                push::Hop::Plain(None) => {
                    owed.settle(s);
                }
            }
        }
        let input = inputs[s].clone();
        let tag = micro.tag;
        let prefer = match s {
            0 => *admitted,
            _ => first.and_then(|p| call::lane(ctx, s, p)),
        };
        let (peer, (out, step)) = call_stage(ctx, s, prefer, n, |peer, step| {
            let c = ctx.client.clone();
            let input = input.clone();
            let step = tag.unwrap_or(step);
            async move { c.forward_step(peer, s, step, mb, &input).await }
        })
        .await?;
        note(s, step, &mut micro);
        owed.add(s, peer);
        if s == 0 && sync {
            first = Some(peer);
            *admitted = Some(peer);
        }
        inputs.push(out);
    }
    let mut upstream = y.clone();
    let mut stage0: Option<(PeerId, u64)> = None;
    for s in (0..=last).rev() {
        if s == 0 && !ctx.cfg.sync_steps {
            // Without waiting for steps, the next microbatch's first forward goes out with
            // this one's last backward: the two cross the link at once.
            permit.take();
        }
        let ran_forward = owed.settle(s);
        let reply = match pushed.take() {
            Some(done) => done,
            None => {
                let input = inputs[s].clone();
                let up = upstream.clone();
                let tag = tags[s].or(micro.tag);
                call_stage(ctx, s, ran_forward, n, |peer, step| {
                    let c = ctx.client.clone();
                    let (input, up) = (input.clone(), up.clone());
                    let step = tag.unwrap_or(step);
                    async move { c.backward(peer, s, step, mb, &input, &up).await }
                })
                .await?
            }
        };
        let (peer, reply) = reply;
        if s == 0 {
            stage0 = Some((peer, reply.step));
        }
        ctx.stats.stage_backward[s].fetch_add(n, Ordering::Relaxed);
        ctx.stats.step.fetch_max(reply.step, Ordering::Relaxed);
        ctx.stats.stage_steps[s].fetch_max(reply.step, Ordering::Relaxed);
        if let Some(l) = reply.loss {
            ctx.stats.record_loss(reply.step, l);
        }
        match reply.grad_input {
            Some(g) => upstream = g,
            None if s > 0 => {
                return Err(Failure::Failed(format!(
                    "stage {s} returned no input gradient"
                )))
            }
            None => {}
        }
    }
    Ok(stage0)
}
