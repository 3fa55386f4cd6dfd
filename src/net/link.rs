//! Home-link emulation for tests and benchmarks: a wrapper around a peer's TCP sockets that
//! limits bandwidth per direction (token buckets) and adds one-way latency, in user space
//! (no root, no `tc`).
//!
//! The model is the peer's access link: what it sends goes through its `up` bucket, what
//! it receives is held for `rtt / 2` and then released through its `down` bucket. Two
//! peers with `rtt=50ms` therefore see a 50 ms round trip between them, and data from A to
//! B flows at `min(A.up, B.down)`. Received bytes wait in a bounded buffer: when it is
//! full the wrapper stops reading and TCP's own flow control pushes back on the sender.
//!
//! The buckets belong to the peer ([`SharedLink`]): all its connections share its bandwidth.
//! Only TCP is shaped: with emulation on, the peer does not use QUIC.

use futures::{AsyncRead, AsyncWrite};
use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::{Instant, Sleep};

/// An emulated access link. `None` bandwidth means unlimited.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSpec {
    /// Upload bandwidth, bytes per second.
    pub up: Option<f64>,
    /// Download bandwidth, bytes per second.
    pub down: Option<f64>,
    /// Round trip between two peers with this setting (each delays what it receives by
    /// half of it).
    pub rtt: Duration,
}

impl fmt::Display for LinkSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bw = |b: Option<f64>| match b {
            Some(b) => format!("{:.1}mbit", b * 8.0 / 1e6),
            None => "unlimited".into(),
        };
        write!(
            f,
            "up={},down={},rtt={}ms",
            bw(self.up),
            bw(self.down),
            self.rtt.as_millis()
        )
    }
}

/// Why a link spec does not parse.
#[derive(Debug, thiserror::Error)]
#[error("bad link spec {spec:?}: {why} (example: bw=100mbit,rtt=50ms or up=20mbit,down=100mbit,rtt=30ms)")]
pub struct LinkSpecError {
    spec: String,
    why: String,
}

fn parse_rate(v: &str) -> Result<f64, String> {
    let v = v.trim().to_ascii_lowercase();
    let (num, mult) = [
        ("gbit", 1e9 / 8.0),
        ("mbit", 1e6 / 8.0),
        ("kbit", 1e3 / 8.0),
        ("bit", 1.0 / 8.0),
    ]
    .iter()
    .find_map(|(suffix, m)| v.strip_suffix(suffix).map(|n| (n.to_string(), *m)))
    .ok_or_else(|| format!("rate {v:?} needs a unit: kbit, mbit or gbit"))?;
    let x: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{num:?} is not a number"))?;
    if !x.is_finite() || x <= 0.0 {
        return Err(format!("rate {v:?} must be positive"));
    }
    Ok(x * mult)
}

fn parse_duration(v: &str) -> Result<Duration, String> {
    let v = v.trim().to_ascii_lowercase();
    let (num, scale) = if let Some(n) = v.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = v.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1.0)
    } else {
        return Err(format!("duration {v:?} needs a unit: us, ms or s"));
    };
    let x: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{num:?} is not a number"))?;
    if !x.is_finite() || !(0.0..=60.0).contains(&(x * scale)) {
        return Err(format!("duration {v:?} must be between 0 and 60 s"));
    }
    Ok(Duration::from_secs_f64(x * scale))
}

impl LinkSpec {
    /// An unlimited link without delay.
    pub fn unlimited() -> Self {
        Self {
            up: None,
            down: None,
            rtt: Duration::ZERO,
        }
    }

    /// Parses `bw=100mbit,rtt=50ms`; keys: `bw` (both directions), `up`, `down`, `rtt`.
    pub fn parse(spec: &str) -> Result<Self, LinkSpecError> {
        let fail = |why: String| LinkSpecError {
            spec: spec.to_string(),
            why,
        };
        let mut out = Self::unlimited();
        if spec.trim().is_empty() {
            return Err(fail("it is empty".into()));
        }
        for part in spec.split(',') {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| fail(format!("{part:?} is not key=value")))?;
            match k.trim() {
                "bw" => {
                    let r = parse_rate(v).map_err(fail)?;
                    out.up = Some(r);
                    out.down = Some(r);
                }
                "up" => out.up = Some(parse_rate(v).map_err(fail)?),
                "down" => out.down = Some(parse_rate(v).map_err(fail)?),
                "rtt" => out.rtt = parse_duration(v).map_err(fail)?,
                other => return Err(fail(format!("unknown key {other:?}"))),
            }
        }
        Ok(out)
    }

    /// Bytes received that may wait in the delay line: twice what the link carries in a
    /// round trip, and at least 256 KiB.
    fn buffer_cap(&self) -> usize {
        let bdp = self.down.unwrap_or(1.25e9) * self.rtt.as_secs_f64();
        ((2.0 * bdp) as usize).clamp(256 << 10, 64 << 20)
    }
}

/// The least a bucket grants at once (about a packet), unless less was asked for.
const MIN_GRANT: f64 = 4096.0;

/// A token bucket in bytes.
struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new(rate: f64) -> Self {
        // A burst of 2 ms of traffic (at least 8 KiB): small enough that the rate holds
        // over a few milliseconds, large enough not to cost a timer per packet.
        let burst = (rate * 0.002).max(8192.0);
        Self {
            rate,
            burst,
            tokens: burst,
            at: Instant::now(),
        }
    }

    fn refill(&mut self) {
        let now = Instant::now();
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        self.at = now;
    }

    /// Bytes that may pass now, at most `want`; when fewer than a packet's worth
    /// (`min(want, MIN_GRANT)`) are there, the instant they will be. Granting less would
    /// let sockets sharing a drained bucket trickle through a few bytes per poll, and the
    /// polling would eat the CPU the swarm needs.
    fn take(&mut self, want: usize) -> Result<usize, Instant> {
        self.refill();
        let floor = (want as f64).min(MIN_GRANT).min(self.burst).max(1.0);
        if self.tokens >= floor {
            Ok((self.tokens as usize).min(want))
        } else {
            Err(self.at + Duration::from_secs_f64((floor - self.tokens) / self.rate))
        }
    }

    fn spend(&mut self, n: usize) {
        self.tokens -= n as f64;
    }
}

/// A peer's access link: the token buckets every one of its sockets shares (the link's
/// bandwidth is the peer's, not each connection's).
pub struct SharedLink {
    spec: LinkSpec,
    up: Option<parking_lot::Mutex<Bucket>>,
    down: Option<parking_lot::Mutex<Bucket>>,
}

impl SharedLink {
    /// The link of one peer.
    pub fn new(spec: LinkSpec) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            spec,
            up: spec.up.map(|r| parking_lot::Mutex::new(Bucket::new(r))),
            down: spec.down.map(|r| parking_lot::Mutex::new(Bucket::new(r))),
        })
    }

    /// Its settings.
    pub fn spec(&self) -> LinkSpec {
        self.spec
    }
}

fn with_bucket<T>(b: &parking_lot::Mutex<Bucket>, f: impl FnOnce(&mut Bucket) -> T) -> T {
    let mut g = b.lock();
    f(&mut g)
}

/// Bytes one socket read may take into the delay line.
const SCRATCH: usize = 64 << 10;

thread_local! {
    /// Where socket reads land before they join the delay line, one per thread for all
    /// the sockets it polls: a fresh zeroed 64 KiB per poll cost more CPU than the rest of
    /// the swarm together, and one per socket was 2.8 GB of zeroed pages (and a tenth of
    /// the CPU) for the 44,000 sockets of a simulated swarm of 200. (Borrowed only around
    /// the inner socket's read, which never polls another `Shaped`.)
    static SCRATCH_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A socket behind an emulated link.
pub struct Shaped<S> {
    inner: S,
    delay: Duration,
    link: Option<std::sync::Arc<SharedLink>>,
    /// Received bytes with the instant they may be read.
    queue: VecDeque<(Instant, Vec<u8>, usize)>,
    queued: usize,
    cap: usize,
    eof: bool,
    read_timer: Pin<Box<Sleep>>,
    write_timer: Pin<Box<Sleep>>,
    passthrough: bool,
}

impl<S> Shaped<S> {
    /// Wraps `inner`; `None` passes everything through untouched.
    pub fn new(inner: S, link: Option<std::sync::Arc<SharedLink>>) -> Self {
        let l = link.as_ref().map_or_else(LinkSpec::unlimited, |l| l.spec);
        Self {
            inner,
            delay: l.rtt / 2,
            passthrough: link.is_none(),
            link,
            queue: VecDeque::new(),
            queued: 0,
            cap: l.buffer_cap(),
            eof: false,
            read_timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            write_timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
        }
    }
}

/// Arms `timer` for `at` and polls it; `true` when it has already fired.
fn arm(timer: &mut Pin<Box<Sleep>>, at: Instant, cx: &mut Context<'_>) -> bool {
    timer.as_mut().reset(at);
    timer.as_mut().poll(cx).is_ready()
}

impl<S: AsyncRead + Unpin> AsyncRead for Shaped<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.passthrough {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        loop {
            // Take in what the socket has, up to the buffer's cap.
            while !this.eof && this.queued < this.cap {
                let read = SCRATCH_BUF.with_borrow_mut(|scratch| {
                    scratch.resize(SCRATCH, 0);
                    Pin::new(&mut this.inner)
                        .poll_read(cx, scratch)
                        .map_ok(|n| scratch[..n].to_vec())
                });
                match read {
                    Poll::Ready(Ok(chunk)) if chunk.is_empty() => this.eof = true,
                    Poll::Ready(Ok(chunk)) => {
                        this.queued += chunk.len();
                        this.queue
                            .push_back((Instant::now() + this.delay, chunk, 0));
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => break,
                }
            }
            let Some((due, _, _)) = this.queue.front() else {
                return if this.eof {
                    Poll::Ready(Ok(0))
                } else {
                    Poll::Pending
                };
            };
            let due = *due;
            if due > Instant::now() {
                if arm(&mut this.read_timer, due, cx) {
                    continue;
                }
                return Poll::Pending;
            }
            let Some((_, chunk, off)) = this.queue.front_mut() else {
                continue;
            };
            let avail = (chunk.len() - *off).min(buf.len());
            let down = this.link.as_ref().and_then(|l| l.down.as_ref());
            let n = match down.map(|b| with_bucket(b, |b| b.take(avail))) {
                None => avail,
                Some(Ok(n)) => n,
                Some(Err(at)) => {
                    if arm(&mut this.read_timer, at, cx) {
                        continue;
                    }
                    return Poll::Pending;
                }
            };
            buf[..n].copy_from_slice(&chunk[*off..*off + n]);
            *off += n;
            if *off == chunk.len() {
                this.queue.pop_front();
            }
            this.queued -= n;
            if let Some(b) = down {
                with_bucket(b, |b| b.spend(n));
            }
            return Poll::Ready(Ok(n));
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Shaped<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        loop {
            let up = this.link.as_ref().and_then(|l| l.up.as_ref());
            let n = match up.map(|b| with_bucket(b, |b| b.take(buf.len()))) {
                None => buf.len(),
                Some(Ok(n)) => n,
                Some(Err(at)) => {
                    if arm(&mut this.write_timer, at, cx) {
                        continue;
                    }
                    return Poll::Pending;
                }
            };
            let r = Pin::new(&mut this.inner).poll_write(cx, &buf[..n]);
            if let (Poll::Ready(Ok(w)), Some(b)) = (&r, up) {
                with_bucket(b, |b| b.spend(*w));
            }
            return r;
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rates_and_delays() {
        let l = LinkSpec::parse("bw=100mbit,rtt=50ms").unwrap();
        assert_eq!(l.up, Some(12.5e6));
        assert_eq!(l.down, Some(12.5e6));
        assert_eq!(l.rtt, Duration::from_millis(50));
        let l = LinkSpec::parse("up=8kbit, down=1gbit").unwrap();
        assert_eq!(l.up, Some(1000.0));
        assert_eq!(l.down, Some(1.25e8));
        assert_eq!(l.rtt, Duration::ZERO);
        for bad in [
            "",
            "bw=100",
            "bw=-1mbit",
            "rtt=5",
            "rtt=100s",
            "speed=1mbit",
            "bw",
        ] {
            let e = LinkSpec::parse(bad).unwrap_err().to_string();
            assert!(e.contains("bad link spec"), "{bad}: {e}");
        }
    }

    async fn pair() -> (libp2p::tcp::tokio::TcpStream, libp2p::tcp::tokio::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (c, s) = tokio::join!(tokio::net::TcpStream::connect(addr), l.accept());
        (
            libp2p::tcp::tokio::TcpStream(c.unwrap()),
            libp2p::tcp::tokio::TcpStream(s.unwrap().0),
        )
    }

    /// Sends `n` bytes from `tx` to `rx`; returns (first byte, all bytes) times.
    async fn transfer(
        mut tx: impl AsyncWrite + Unpin + Send + 'static,
        mut rx: impl AsyncRead + Unpin,
        n: usize,
    ) -> (Duration, Duration, Vec<u8>) {
        use futures::{AsyncReadExt, AsyncWriteExt};
        let data: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        let sent = data.clone();
        let t0 = Instant::now();
        let w = tokio::spawn(async move {
            tx.write_all(&sent).await.unwrap();
            tx.flush().await.unwrap();
            tx
        });
        let mut got = vec![0u8; n];
        rx.read_exact(&mut got[..1]).await.unwrap();
        let first = t0.elapsed();
        rx.read_exact(&mut got[1..]).await.unwrap();
        let all = t0.elapsed();
        drop(w.await.unwrap());
        assert_eq!(got, data, "bytes changed on the way");
        (first, all, got)
    }

    #[tokio::test]
    async fn receiving_side_adds_half_the_rtt_and_holds_the_down_rate() {
        let (a, b) = pair().await;
        let link = LinkSpec::parse("down=8mbit,rtt=200ms").unwrap();
        let (first, all, _) =
            transfer(a, Shaped::new(b, Some(SharedLink::new(link))), 500_000).await;
        // Lower bounds only: a slow machine can only make these longer.
        assert!(
            first >= Duration::from_millis(95),
            "first byte after {first:?}"
        );
        // 500 kB at 1 MB/s, less the initial burst, plus the delay.
        assert!(all >= Duration::from_millis(550), "500 kB took {all:?}");
        assert!(all < Duration::from_secs(10), "500 kB took {all:?}");
    }

    #[tokio::test]
    async fn sending_side_holds_the_up_rate() {
        let (a, b) = pair().await;
        let link = LinkSpec::parse("up=16mbit").unwrap();
        let (first, all, _) =
            transfer(Shaped::new(a, Some(SharedLink::new(link))), b, 1_000_000).await;
        assert!(first < Duration::from_secs(5));
        assert!(
            all >= Duration::from_millis(450),
            "1 MB at 2 MB/s took {all:?}"
        );
    }

    #[tokio::test]
    async fn connections_of_one_peer_share_its_bandwidth() {
        // Two connections behind one 16 Mbit/s uplink: 1 MB each takes about 1 s together,
        // not 0.5 s as two separate links would allow.
        let link = SharedLink::new(LinkSpec::parse("up=16mbit").unwrap());
        let (a1, b1) = pair().await;
        let (a2, b2) = pair().await;
        let t0 = Instant::now();
        let (r1, r2) = tokio::join!(
            transfer(Shaped::new(a1, Some(link.clone())), b1, 1_000_000),
            transfer(Shaped::new(a2, Some(link)), b2, 1_000_000)
        );
        let both = t0.elapsed();
        assert!(r1.1 < Duration::from_secs(20) && r2.1 < Duration::from_secs(20));
        assert!(
            both >= Duration::from_millis(900),
            "2 MB at 2 MB/s took {both:?}"
        );
    }

    #[tokio::test]
    async fn no_link_passes_through() {
        let (a, b) = pair().await;
        let (_, all, _) = transfer(Shaped::new(a, None), Shaped::new(b, None), 1 << 20).await;
        assert!(all < Duration::from_secs(10));
    }
}
