//! [`Runtime`](super::Runtime) over the runtime's CRI socket, on the installer's shared
//! async runtime. A connection is made on first use and dropped after an error, so a
//! restarted runtime is simply reached again on the next pass.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use aether_cri::{Client, Error, Sandbox};

use super::PodNetwork;

pub struct CriRuntime {
    socket: PathBuf,
    timeout: Duration,
    max_message: usize,
    rt: Arc<tokio::runtime::Runtime>,
    client: Option<Client>,
}

impl CriRuntime {
    pub fn new(socket: PathBuf, timeout: Duration, max_message: usize, rt: Arc<tokio::runtime::Runtime>) -> Self {
        CriRuntime { socket, timeout, max_message, rt, client: None }
    }

    fn with<T>(
        &mut self,
        call: impl for<'c> FnOnce(
            &'c mut Client,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, Error>> + 'c>>,
    ) -> Result<T, Error> {
        let rt = self.rt.clone();
        if self.client.is_none() {
            self.client = Some(rt.block_on(Client::connect_with(&self.socket, self.timeout, self.max_message))?);
        }
        let out = rt.block_on(call(self.client.as_mut().expect("connected above")));
        if out.is_err() {
            self.client = None;
        }
        out
    }
}

impl super::Runtime for CriRuntime {
    type Error = Error;

    fn sandboxes(&mut self) -> Result<Vec<Sandbox>, Error> {
        self.with(|c| Box::pin(c.sandboxes()))
    }

    fn network(&mut self, sandbox_id: &str) -> Result<PodNetwork, Error> {
        let id = sandbox_id.to_string();
        self.with(move |c| {
            Box::pin(async move { c.status(&id).await.map(|s| PodNetwork { netns: s.netns, ips: s.ips }) })
        })
    }

    fn stop(&mut self, sandbox_id: &str) -> Result<(), Error> {
        let id = sandbox_id.to_string();
        self.with(move |c| Box::pin(async move { c.stop(&id).await }))?;
        // Tests kill the installer here, mid-pass, to prove a restart is neither lost nor
        // done twice (fault-injection builds only).
        aether_node::state::crash_point("reconciler-after-restart");
        Ok(())
    }
}
