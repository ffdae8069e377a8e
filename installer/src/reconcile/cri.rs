//! [`Runtime`](super::Runtime) over the runtime's CRI socket, on the installer's shared
//! async runtime. A connection is made on first use and dropped after an error, so a
//! restarted runtime is simply reached again on the next pass.
//!
//! Every call is bounded three ways: by `--cri-timeout-seconds`, by what is left of the pass's
//! budget for the runtime (a pass never waits on the runtime longer than that in all), and by
//! the installer's stop, which cancels a call in flight at once.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_cri::{Client, Sandbox};

use super::{PodNetwork, Stopping};

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error(transparent)]
    Cri(#[from] aether_cri::Error),
    #[error("not asked: this pass's time for the runtime ({0:?}) is spent")]
    BudgetSpent(Duration),
    #[error("not asked: the installer is stopping")]
    Stopping,
}

pub struct CriRuntime {
    socket: PathBuf,
    timeout: Duration,
    max_message: usize,
    rt: Arc<tokio::runtime::Runtime>,
    client: Option<Client>,
    budget: Duration,
    /// When this pass's budget for the runtime ends.
    deadline: Option<Instant>,
    stopping: Stopping,
}

impl CriRuntime {
    pub fn new(
        socket: PathBuf,
        timeout: Duration,
        max_message: usize,
        budget: Duration,
        stopping: Stopping,
        rt: Arc<tokio::runtime::Runtime>,
    ) -> Self {
        CriRuntime { socket, timeout, max_message, rt, client: None, budget, deadline: None, stopping }
    }

    /// The time a call may take now: the per-call timeout, within what is left of the pass's
    /// budget.
    fn allowed(&self) -> Result<Duration, CallError> {
        if self.stopping.is_set() {
            return Err(CallError::Stopping);
        }
        let left = self.deadline.map_or(self.timeout, |d| d.saturating_duration_since(Instant::now()));
        if left.is_zero() {
            return Err(CallError::BudgetSpent(self.budget));
        }
        Ok(left.min(self.timeout))
    }

    fn with<T>(
        &mut self,
        call: impl for<'c> FnOnce(
            &'c mut Client,
        )
            -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, aether_cri::Error>> + 'c>>,
    ) -> Result<T, CallError> {
        let allowed = self.allowed()?;
        let rt = self.rt.clone();
        let mut stop = self.stopping.watch();
        let (socket, max_message) = (self.socket.clone(), self.max_message);
        let client = &mut self.client;
        let out = rt.block_on(async move {
            let work = async {
                if client.is_none() {
                    *client = Some(Client::connect_with(&socket, allowed, max_message).await?);
                }
                let c = client.as_mut().expect("connected above");
                c.set_timeout(allowed);
                call(c).await
            };
            tokio::select! {
                out = work => out.map_err(CallError::Cri),
                _ = stop.wait_for(|stopping| *stopping) => Err(CallError::Stopping),
            }
        });
        if out.is_err() {
            self.client = None;
        }
        out
    }
}

impl super::Runtime for CriRuntime {
    type Error = CallError;

    fn begin_pass(&mut self) {
        self.deadline = Some(Instant::now() + self.budget);
    }

    fn budget_spent(&self) -> bool {
        self.allowed().is_err()
    }

    fn sandboxes(&mut self) -> Result<Vec<Sandbox>, CallError> {
        self.with(|c| Box::pin(c.sandboxes()))
    }

    fn network(&mut self, sandbox_id: &str) -> Result<PodNetwork, CallError> {
        let id = sandbox_id.to_string();
        self.with(move |c| {
            Box::pin(async move { c.status(&id).await.map(|s| PodNetwork { netns: s.netns, ips: s.ips }) })
        })
    }

    fn stop(&mut self, sandbox_id: &str) -> Result<(), CallError> {
        let id = sandbox_id.to_string();
        self.with(move |c| Box::pin(async move { c.stop(&id).await }))?;
        // Tests kill the installer here, mid-pass, to prove a restart is neither lost nor
        // done twice (fault-injection builds only).
        aether_node::state::crash_point("reconciler-after-restart");
        Ok(())
    }
}
