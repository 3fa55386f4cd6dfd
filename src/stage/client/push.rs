//! The calls of pushed activations ([`crate::stage::service::push`]): a forward whose
//! output goes on to a replica of the next stage, the request there that waits for it, and
//! the push itself between the two replicas.

use super::{BackwardReply, CallError, StageClient};
use crate::stage::tensor;
use crate::wire::msg::Call;
use candle_core::Tensor;
use libp2p::PeerId;

impl StageClient {
    /// Forward through `stage` on `peer`, its output pushed to `to` (a replica of the next
    /// stage) for microbatch `mb`. Returns the output when the push failed (the replica
    /// answers with it then), and the replica's step.
    pub async fn forward_pushing(
        &self,
        peer: PeerId,
        stage: usize,
        step: u64,
        mb: u64,
        input: &Tensor,
        to: PeerId,
    ) -> Result<(Option<Tensor>, u64), CallError> {
        let call = self.forward_call(mb, false, Some(to.to_string()));
        let req = self.request(stage, step, call, 1);
        let frame = tensor::encode(input, &self.codec)?;
        let (header, frames) = self.call(peer, &req, &[frame.as_slice()]).await?;
        self.count_raw(&[input]);
        Ok((self.reply_tensor(&frames, "forward")?, header.step))
    }

    /// Backward through `stage` on `peer` of microbatch `mb`, whose input the previous
    /// stage's replica pushes there: only `upstream` (the targets on the last stage) is sent.
    pub async fn backward_pushed(
        &self,
        peer: PeerId,
        stage: usize,
        step: u64,
        mb: u64,
        upstream: &Tensor,
    ) -> Result<BackwardReply, CallError> {
        let req = self.request(stage, step, self.backward_call(mb, false, true), 1);
        let frame = tensor::encode(upstream, &self.codec)?;
        let (header, frames) = self.call(peer, &req, &[frame.as_slice()]).await?;
        self.count_raw(&[upstream]);
        let grad_input = self.reply_tensor(&frames, "backward")?;
        Ok(BackwardReply {
            loss: header.loss,
            grad_input,
            step: header.step,
        })
    }

    /// Pushes the encoded `frame` (a forward's output) to `peer`, a replica of `stage`, as
    /// the input of microbatch `mb`.
    pub async fn push(
        &self,
        peer: PeerId,
        stage: usize,
        step: u64,
        mb: u64,
        frame: &[u8],
    ) -> Result<(), CallError> {
        let req = self.request(stage, step, Call::Push { mb }, 1);
        self.call(peer, &req, &[frame]).await.map(|_| ())
    }
}
