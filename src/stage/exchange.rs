//! One request and its answer on one stream: the request is written while the response
//! is read, so a replica that refuses early (a frame over its limit, a full queue) is
//! heard at once instead of leaving the caller blocked on a write nobody reads.

use super::client::CallError;
use crate::net::io::{self as netio, IoError};
use crate::wire::msg::{Request, Response};
use crate::wire::Limits;
use futures::{AsyncReadExt, AsyncWriteExt};

/// Writes the request (once one of `sending`'s permits is free) and reads the response
/// concurrently on one stream, without closing it: the stream is handed back when the
/// answer was a success, for the next request (the server then waits for one on it).
pub async fn exchange_kept(
    stream: libp2p::Stream,
    req: &Request,
    frames: &[&[u8]],
    limits: &Limits,
    sending: &tokio::sync::Semaphore,
) -> (
    Result<(Response, Vec<Vec<u8>>), CallError>,
    Option<libp2p::Stream>,
) {
    exchange_on(stream, req, frames, limits, Some(sending)).await
}

/// Writes the request and reads the response concurrently on one stream, closing the
/// sending side after the request (a one-shot call).
pub async fn exchange(
    stream: libp2p::Stream,
    req: &Request,
    frames: &[&[u8]],
    limits: &Limits,
) -> Result<(Response, Vec<Vec<u8>>), CallError> {
    exchange_on(stream, req, frames, limits, None).await.0
}

/// One request and its answer, read while the request is still being written (a replica
/// may refuse before it has read everything). With `sending`, the write waits for one of
/// its permits and the stream stays open, handed back after a successful answer; without,
/// the sending side is closed after the request and nothing is handed back.
async fn exchange_on(
    stream: libp2p::Stream,
    req: &Request,
    frames: &[&[u8]],
    limits: &Limits,
    sending: Option<&tokio::sync::Semaphore>,
) -> (
    Result<(Response, Vec<Vec<u8>>), CallError>,
    Option<libp2p::Stream>,
) {
    let (mut r, mut w) = stream.split();
    let mut wrote = false;
    let result = {
        let write = async {
            let _slot = match sending {
                Some(s) => s.acquire().await.ok(),
                None => None,
            };
            netio::write_message(&mut w, req, frames).await?;
            if sending.is_none() {
                w.close().await.map_err(IoError::from)?;
            }
            Ok::<_, IoError>(())
        };
        let read = netio::read_response(&mut r, limits);
        tokio::pin!(write, read);
        let mut write_err = None;
        let mut writing = true;
        loop {
            tokio::select! {
                res = &mut write, if writing => {
                    writing = false;
                    match res {
                        Ok(()) => wrote = true,
                        Err(e) => write_err = Some(e),
                    }
                }
                res = &mut read => {
                    break match (res, write_err) {
                        (Ok(x), _) => Ok(x),
                        (Err(_), Some(we)) => Err(CallError::from(we)),
                        (Err(re), None) => Err(CallError::from(re)),
                    };
                }
            }
        }
    };
    let reusable = sending.is_some() && wrote && matches!(&result, Ok((h, _)) if h.error.is_none());
    let back = if reusable { r.reunite(w).ok() } else { None };
    (result, back)
}
