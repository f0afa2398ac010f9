//! The reply to a request sent to the engine thread: wait for it, or `.await` it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use crate::error::{Error, Result};

/// A result the engine thread will deliver. `wait()` blocks (never call it inside an async
/// runtime); awaiting it does not block.
#[must_use = "a Pending does nothing unless waited for or awaited"]
pub struct Pending<T>(oneshot::Receiver<Result<T>>);

pub(crate) type Reply<T> = oneshot::Sender<Result<T>>;

impl<T> Pending<T> {
    pub(crate) fn channel() -> (Reply<T>, Pending<T>) {
        let (tx, rx) = oneshot::channel();
        (tx, Pending(rx))
    }

    /// A Pending that is already resolved (errors found before any work was queued).
    pub fn ready(result: Result<T>) -> Self {
        let (tx, p) = Self::channel();
        let _ = tx.send(result);
        p
    }

    /// Block the calling thread until the engine replies.
    pub fn wait(self) -> Result<T> {
        self.0.blocking_recv().unwrap_or(Err(Error::Closed))
    }
}

impl<T> Future for Pending<T> {
    type Output = Result<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0)
            .poll(cx)
            .map(|r| r.unwrap_or(Err(Error::Closed)))
    }
}
