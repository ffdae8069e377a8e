//! A fake container runtime for the tests (feature `fake`): tonic's server side of the same
//! proto, on a unix socket, answering what the test tells it to: the node's sandboxes, or an
//! empty, huge, slow, hung, erroring, duplicated or misdirected list; each sandbox's verbose
//! status (or a hang, or an error); StopPodSandbox, remembered. Every call is counted.
//!
//! It runs on a thread of its own with its own tokio runtime; dropping it stops the thread
//! and removes the socket. A hung answer is a future that never ends, dropped with the
//! runtime.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tonic::{Request, Response, Status};

use crate::api;
use crate::api::runtime_service_server::{RuntimeService, RuntimeServiceServer};

/// How the fake answers one kind of call.
#[derive(Debug, Clone)]
pub enum Reply<T> {
    Answer(T),
    /// After this long.
    Slow(Duration, T),
    /// Never.
    Hang,
    Fail(tonic::Code, String),
}

/// What the fake runtime answers, changed by the test at any time.
#[derive(Debug, Clone)]
pub struct Script {
    pub list: Reply<Vec<api::PodSandbox>>,
    /// By sandbox ID; a sandbox without an entry is NotFound.
    pub status: HashMap<String, Reply<api::PodSandboxStatusResponse>>,
    pub stop: Reply<()>,
}

impl Default for Script {
    fn default() -> Self {
        Script { list: Reply::Answer(Vec::new()), status: HashMap::new(), stop: Reply::Answer(()) }
    }
}

#[derive(Default)]
struct State {
    script: Script,
    /// Every call, in order: `list`, `status <id>`, `stop <id>`, `version`.
    calls: Vec<String>,
}

/// The running fake.
pub struct FakeRuntime {
    socket: PathBuf,
    state: Arc<Mutex<State>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeRuntime {
    /// Listens on `socket` (replaced if it exists) and answers by `script`.
    pub fn start(socket: &Path, script: Script) -> std::io::Result<FakeRuntime> {
        let _ = std::fs::remove_file(socket);
        let listener = std::os::unix::net::UnixListener::bind(socket)?;
        listener.set_nonblocking(true)?;
        let state = Arc::new(Mutex::new(State { script, calls: Vec::new() }));
        let service = Service(state.clone());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new().name("fake-cri".into()).spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime");
            rt.block_on(serve(listener, service, stopped));
            // Dropping the runtime cancels the connections, hung answers included.
        })?;
        Ok(FakeRuntime { socket: socket.to_path_buf(), state, stop: Some(stop), thread: Some(thread) })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Changes what the fake answers from the next call on.
    pub fn script(&self, change: impl FnOnce(&mut Script)) {
        change(&mut self.state.lock().unwrap().script);
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<String> {
        self.state.lock().unwrap().calls.clone()
    }

    /// How many calls so far start with `prefix` (`list`, `status`, `status <id>`, `stop`).
    pub fn count(&self, prefix: &str) -> usize {
        self.state.lock().unwrap().calls.iter().filter(|c| c.starts_with(prefix)).count()
    }
}

impl Drop for FakeRuntime {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

async fn serve(
    listener: std::os::unix::net::UnixListener,
    service: Service,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let listener = tokio::net::UnixListener::from_std(listener).expect("a tokio listener");
    // No limit on what the fake sends: the client's limit is what is tested.
    let server = RuntimeServiceServer::new(service).max_encoding_message_size(usize::MAX);
    loop {
        let stream = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
        };
        let svc = hyper_util::service::TowerToHyperService::new(server.clone());
        tokio::spawn(async move {
            let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
        });
    }
}

#[derive(Clone)]
struct Service(Arc<Mutex<State>>);

impl Service {
    fn take<T: Clone>(&self, call: String, pick: impl FnOnce(&Script) -> Reply<T>) -> Reply<T> {
        let mut s = self.0.lock().unwrap();
        s.calls.push(call);
        pick(&s.script)
    }
}

async fn answer<T>(reply: Reply<T>) -> Result<Response<T>, Status> {
    match reply {
        Reply::Answer(t) => Ok(Response::new(t)),
        Reply::Slow(d, t) => {
            tokio::time::sleep(d).await;
            Ok(Response::new(t))
        }
        Reply::Hang => std::future::pending().await,
        Reply::Fail(code, message) => Err(Status::new(code, message)),
    }
}

#[tonic::async_trait]
impl RuntimeService for Service {
    async fn version(&self, _: Request<api::VersionRequest>) -> Result<Response<api::VersionResponse>, Status> {
        self.take("version".into(), |_| Reply::Answer(()));
        Ok(Response::new(api::VersionResponse {
            version: "0.1.0".into(),
            runtime_name: "fake".into(),
            runtime_version: "0".into(),
            runtime_api_version: "v1".into(),
        }))
    }

    async fn run_pod_sandbox(
        &self,
        _: Request<api::RunPodSandboxRequest>,
    ) -> Result<Response<api::RunPodSandboxResponse>, Status> {
        Err(Status::unimplemented("the fake runtime runs no sandbox"))
    }

    async fn stop_pod_sandbox(
        &self,
        r: Request<api::StopPodSandboxRequest>,
    ) -> Result<Response<api::StopPodSandboxResponse>, Status> {
        let id = r.into_inner().pod_sandbox_id;
        let reply = self.take(format!("stop {id}"), |s| s.stop.clone());
        answer(reply).await.map(|_| Response::new(api::StopPodSandboxResponse {}))
    }

    async fn remove_pod_sandbox(
        &self,
        _: Request<api::RemovePodSandboxRequest>,
    ) -> Result<Response<api::RemovePodSandboxResponse>, Status> {
        Err(Status::unimplemented("the fake runtime removes no sandbox"))
    }

    async fn pod_sandbox_status(
        &self,
        r: Request<api::PodSandboxStatusRequest>,
    ) -> Result<Response<api::PodSandboxStatusResponse>, Status> {
        let id = r.into_inner().pod_sandbox_id;
        let reply = self.take(format!("status {id}"), |s| {
            s.status
                .get(&id)
                .cloned()
                .unwrap_or_else(|| Reply::Fail(tonic::Code::NotFound, format!("sandbox {id} not found")))
        });
        answer(reply).await
    }

    async fn list_pod_sandbox(
        &self,
        _: Request<api::ListPodSandboxRequest>,
    ) -> Result<Response<api::ListPodSandboxResponse>, Status> {
        let reply = self.take("list".into(), |s| s.list.clone());
        answer(reply).await.map(|r| r.map(|items| api::ListPodSandboxResponse { items }))
    }

    async fn status(&self, _: Request<api::StatusRequest>) -> Result<Response<api::StatusResponse>, Status> {
        Err(Status::unimplemented("the fake runtime has no status"))
    }
}

/// A ready sandbox of pod `namespace/name` with uid `uid`, created at `created_at`.
pub fn sandbox(id: &str, namespace: &str, name: &str, uid: &str, created_at: i64) -> api::PodSandbox {
    api::PodSandbox {
        id: id.into(),
        metadata: Some(api::PodSandboxMetadata {
            name: name.into(),
            uid: uid.into(),
            namespace: namespace.into(),
            attempt: 0,
        }),
        state: api::PodSandboxState::SandboxReady as i32,
        created_at,
        labels: Default::default(),
        annotations: Default::default(),
        runtime_handler: String::new(),
    }
}

/// The verbose status of `sandbox`, as containerd gives it: its addresses, and the runtime
/// spec naming its network namespace at `netns` (`None`: the node's network).
pub fn status(sandbox: &api::PodSandbox, netns: Option<&str>, ips: &[&str]) -> api::PodSandboxStatusResponse {
    let mut namespaces = vec![serde_json::json!({"type": "pid"})];
    if let Some(path) = netns {
        namespaces.push(serde_json::json!({"type": "network", "path": path}));
    }
    let info = serde_json::json!({"pid": 1, "runtimeSpec": {"linux": {"namespaces": namespaces}}});
    api::PodSandboxStatusResponse {
        status: Some(api::PodSandboxStatus {
            id: sandbox.id.clone(),
            metadata: sandbox.metadata.clone(),
            state: sandbox.state,
            created_at: sandbox.created_at,
            network: Some(api::PodSandboxNetworkStatus {
                ip: ips.first().map_or(String::new(), |s| s.to_string()),
                additional_ips: ips.iter().skip(1).map(|ip| api::PodIp { ip: ip.to_string() }).collect(),
            }),
            labels: Default::default(),
            annotations: sandbox.annotations.clone(),
        }),
        info: BTreeMap::from([("info".to_string(), info.to_string())]).into_iter().collect(),
    }
}
