//! A client of the container runtime's CRI socket: the node's pod sandboxes as the runtime
//! knows them (namespace, name, uid, annotations, state, network namespace), and
//! StopPodSandbox.
//!
//! gRPC over the runtime's unix socket with tonic and prost; the messages are generated from
//! `proto/runtime_v1.proto` (the few CRI v1 calls and fields this project reads, with the
//! published field numbers). The calls are async: the caller owns the runtime (the installer
//! runs one current-thread tokio runtime; the CNI plugin never starts one). Every call is
//! bounded by the timeout given at connection, and every error names the call and the socket.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};
/// The gRPC status code a call failed with (in [`Error::Call`]).
pub use tonic::Code;

/// The generated CRI v1 messages and clients (package `runtime.v1`).
pub mod api {
    tonic::include_proto!("runtime.v1");
}

#[cfg(feature = "fake")]
pub mod fake;

use api::runtime_service_client::RuntimeServiceClient;

/// containerd's CRI socket (its default `grpc.address`).
pub const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";
/// CRI-O's socket (its default `listen`).
pub const CRIO_SOCKET: &str = "/var/run/crio/crio.sock";

/// The largest message read from the runtime by default: the kubelet's own limit (16 MiB).
/// tonic's default, 4 MiB, is less than a node's pod list can be (110 sandboxes with large
/// annotations); a larger list than the limit blinds the reconciler.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;

/// A runtime's message is shown up to this many bytes (a runtime may quote a whole request).
const SHOWN_BYTES: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot connect to the runtime's CRI socket {socket}: {why}")]
    Connect { socket: PathBuf, why: String },
    #[error("{call} on the CRI socket {socket} failed: {code:?}: {message}")]
    Call { call: &'static str, socket: PathBuf, code: tonic::Code, message: String },
    #[error("{call} on the CRI socket {socket}: no answer within {after:?}")]
    Timeout { call: &'static str, socket: PathBuf, after: Duration },
    #[error("PodSandboxStatus of sandbox {id} on {socket}: the runtime's verbose info is unreadable: {why}")]
    Info { id: String, socket: PathBuf, why: String },
}

/// A sandbox's state as the runtime reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxState {
    Ready,
    NotReady,
}

/// One pod sandbox of ListPodSandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sandbox {
    /// The sandbox ID: what the runtime passes to CNI as `CNI_CONTAINERID`.
    pub id: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub attempt: u32,
    pub state: SandboxState,
    /// Nanoseconds since the epoch.
    pub created_at: i64,
    pub annotations: BTreeMap<String, String>,
}

/// Where a sandbox's network lives, from the verbose PodSandboxStatus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SandboxNetns {
    /// A network namespace of its own, at this path (containerd's and CRI-O's runtime spec).
    Pod(String),
    /// No network namespace of its own: the node's (a `hostNetwork` pod).
    Node,
}

/// PodSandboxStatus with `verbose`: the sandbox, its addresses and its network namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxStatus {
    pub sandbox: Sandbox,
    /// The pod's addresses (the first, then `additional_ips`), as the runtime reports them.
    pub ips: Vec<String>,
    pub netns: SandboxNetns,
    /// The sandbox's process, where the runtime says (containerd's `pid`).
    pub pid: Option<u32>,
}

/// A connection to one runtime's CRI socket.
pub struct Client {
    runtime: RuntimeServiceClient<Channel>,
    socket: PathBuf,
    timeout: Duration,
}

/// The runtime's `Version` answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeVersion {
    pub runtime_name: String,
    pub runtime_version: String,
    pub runtime_api_version: String,
}

fn clip(text: &str) -> String {
    if text.len() <= SHOWN_BYTES {
        return text.to_string();
    }
    let mut end = SHOWN_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &text[..end], text.len())
}

impl Client {
    /// Connects to the socket (the runtime must be listening); every later call is bounded by
    /// `timeout`, and its answer by [`DEFAULT_MAX_MESSAGE_BYTES`].
    pub async fn connect(socket: &Path, timeout: Duration) -> Result<Client, Error> {
        Self::connect_with(socket, timeout, DEFAULT_MAX_MESSAGE_BYTES).await
    }

    /// [`Client::connect`], reading answers of up to `max_message` bytes.
    pub async fn connect_with(socket: &Path, timeout: Duration, max_message: usize) -> Result<Client, Error> {
        let path = socket.to_path_buf();
        // The URI is only what HTTP/2 needs for :authority; the connector ignores it.
        // Each call is bounded by `call` (the channel's own request timeout would race it and
        // answer `Cancelled` instead of a timeout naming the call).
        let endpoint = Endpoint::from_static("http://localhost").connect_timeout(timeout);
        let connector = tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        });
        let connect = endpoint.connect_with_connector(connector);
        let channel = match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(channel)) => channel,
            Ok(Err(e)) => return Err(Error::Connect { socket: socket.into(), why: clip(&error_chain(&e)) }),
            Err(_) => {
                return Err(Error::Connect { socket: socket.into(), why: format!("no connection within {timeout:?}") })
            }
        };
        let runtime = RuntimeServiceClient::new(channel).max_decoding_message_size(max_message);
        Ok(Client { runtime, socket: socket.into(), timeout })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Bounds the calls from now on by `timeout` instead (a caller's budget running out).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    async fn call<T>(
        &self,
        call: &'static str,
        answer: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, Error> {
        match tokio::time::timeout(self.timeout, answer).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(status)) => Err(Error::Call {
                call,
                socket: self.socket.clone(),
                code: status.code(),
                message: clip(&status_text(&status)),
            }),
            Err(_) => Err(Error::Timeout { call, socket: self.socket.clone(), after: self.timeout }),
        }
    }

    pub async fn version(&mut self) -> Result<RuntimeVersion, Error> {
        let mut rt = self.runtime.clone();
        let r = self.call("Version", rt.version(api::VersionRequest { version: "v1".into() })).await?;
        Ok(RuntimeVersion {
            runtime_name: r.runtime_name,
            runtime_version: r.runtime_version,
            runtime_api_version: r.runtime_api_version,
        })
    }

    /// Status, verbose: the runtime's verbose info, as it gives it (containerd: `cniconfig`,
    /// the CNI configuration its CRI plugin holds now, as JSON, and `lastCNILoadStatus`).
    pub async fn runtime_info(&mut self) -> Result<BTreeMap<String, String>, Error> {
        let mut rt = self.runtime.clone();
        let r = self.call("Status", rt.status(api::StatusRequest { verbose: true })).await?;
        Ok(r.info.into_iter().collect())
    }

    /// ListPodSandbox: every sandbox the runtime has, ready or not, in the runtime's order.
    pub async fn sandboxes(&mut self) -> Result<Vec<Sandbox>, Error> {
        let mut rt = self.runtime.clone();
        let r = self.call("ListPodSandbox", rt.list_pod_sandbox(api::ListPodSandboxRequest { filter: None })).await?;
        Ok(r.items.into_iter().map(sandbox_of).collect())
    }

    /// PodSandboxStatus, verbose: the sandbox with its addresses and network namespace.
    pub async fn status(&mut self, id: &str) -> Result<SandboxStatus, Error> {
        let mut rt = self.runtime.clone();
        let request = api::PodSandboxStatusRequest { pod_sandbox_id: id.into(), verbose: true };
        let r = self.call("PodSandboxStatus", rt.pod_sandbox_status(request)).await?;
        let info_error = |why: String| Error::Info { id: id.into(), socket: self.socket.clone(), why };
        let status = r.status.ok_or_else(|| info_error("the answer has no status".into()))?;
        let (netns, pid) = parse_info(r.info.get("info").map(String::as_str)).map_err(info_error)?;
        let mut ips = Vec::new();
        if let Some(n) = &status.network {
            ips.extend(std::iter::once(n.ip.clone()).filter(|ip| !ip.is_empty()));
            ips.extend(n.additional_ips.iter().map(|p| p.ip.clone()));
        }
        let sandbox = sandbox_of(api::PodSandbox {
            id: status.id,
            metadata: status.metadata,
            state: status.state,
            created_at: status.created_at,
            labels: Default::default(),
            annotations: status.annotations,
            runtime_handler: String::new(),
        });
        Ok(SandboxStatus { sandbox, ips, netns, pid })
    }

    /// StopPodSandbox: the runtime tears the sandbox's network down (CNI DEL) and stops its
    /// containers; the kubelet then makes a new sandbox for the pod (a real ADD).
    pub async fn stop(&mut self, id: &str) -> Result<(), Error> {
        let mut rt = self.runtime.clone();
        let request = api::StopPodSandboxRequest { pod_sandbox_id: id.into() };
        self.call("StopPodSandbox", rt.stop_pod_sandbox(request)).await.map(|_| ())
    }
}

fn sandbox_of(s: api::PodSandbox) -> Sandbox {
    let meta = s.metadata.unwrap_or_default();
    Sandbox {
        id: s.id,
        namespace: meta.namespace,
        name: meta.name,
        uid: meta.uid,
        attempt: meta.attempt,
        // An unknown state number (a newer runtime's) is not ready: nothing acts on it.
        state: match api::PodSandboxState::try_from(s.state) {
            Ok(api::PodSandboxState::SandboxReady) => SandboxState::Ready,
            _ => SandboxState::NotReady,
        },
        created_at: s.created_at,
        annotations: s.annotations.into_iter().collect(),
    }
}

/// The network namespace and process from the verbose info's `info` document (containerd
/// and CRI-O both put the sandbox's OCI runtime spec in it, as `runtimeSpec`).
fn parse_info(info: Option<&str>) -> Result<(SandboxNetns, Option<u32>), String> {
    let text = info.ok_or("no \"info\" document (is the runtime containerd or CRI-O?)")?;
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("\"info\" is not JSON: {e}"))?;
    let namespaces = v
        .pointer("/runtimeSpec/linux/namespaces")
        .ok_or("\"info\" has no runtimeSpec.linux.namespaces")?
        .as_array()
        .ok_or("runtimeSpec.linux.namespaces is not a list")?;
    let pid = v.get("pid").and_then(serde_json::Value::as_u64).and_then(|p| u32::try_from(p).ok());
    let network = namespaces.iter().find(|n| n.get("type").and_then(|t| t.as_str()) == Some("network"));
    let netns = match network {
        // No network namespace in the spec: the sandbox shares the node's.
        None => SandboxNetns::Node,
        Some(n) => match n.get("path").and_then(|p| p.as_str()) {
            Some(p) if !p.is_empty() => SandboxNetns::Pod(p.to_string()),
            // A namespace of its own with no path: the runtime made it anew for the process.
            _ => match pid {
                Some(pid) if pid > 0 => SandboxNetns::Pod(format!("/proc/{pid}/ns/net")),
                _ => return Err("the network namespace has no path and the sandbox no pid".into()),
            },
        },
    };
    Ok((netns, pid))
}

fn status_text(status: &tonic::Status) -> String {
    let m = status.message();
    if m.is_empty() {
        status.code().description().to_string()
    } else {
        m.to_string()
    }
}

/// An error with its causes (tonic's transport error says little at the top).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_gives_the_network_namespace_path() {
        let info = r#"{"pid":4242,"runtimeSpec":{"linux":{"namespaces":[{"type":"pid"},{"type":"network","path":"/var/run/netns/cni-1234"}]}}}"#;
        assert_eq!(parse_info(Some(info)).unwrap(), (SandboxNetns::Pod("/var/run/netns/cni-1234".into()), Some(4242)));
    }

    #[test]
    fn info_without_a_network_namespace_is_the_node_network() {
        let info = r#"{"pid":7,"runtimeSpec":{"linux":{"namespaces":[{"type":"pid"},{"type":"ipc"}]}}}"#;
        assert_eq!(parse_info(Some(info)).unwrap().0, SandboxNetns::Node);
    }

    #[test]
    fn a_network_namespace_without_path_is_the_process_one() {
        let info = r#"{"pid":99,"runtimeSpec":{"linux":{"namespaces":[{"type":"network"}]}}}"#;
        assert_eq!(parse_info(Some(info)).unwrap().0, SandboxNetns::Pod("/proc/99/ns/net".into()));
        let info = r#"{"runtimeSpec":{"linux":{"namespaces":[{"type":"network"}]}}}"#;
        assert!(parse_info(Some(info)).unwrap_err().contains("no path"));
    }

    #[test]
    fn unreadable_info_says_why() {
        assert!(parse_info(None).unwrap_err().contains("no \"info\""));
        assert!(parse_info(Some("{")).unwrap_err().contains("not JSON"));
        assert!(parse_info(Some(r#"{"runtimeSpec":{}}"#)).unwrap_err().contains("runtimeSpec.linux.namespaces"));
        assert!(parse_info(Some(r#"{"runtimeSpec":{"linux":{"namespaces":{}}}}"#)).unwrap_err().contains("not a list"));
    }

    #[test]
    fn unknown_state_is_not_ready() {
        let s = sandbox_of(api::PodSandbox { state: 7, ..Default::default() });
        assert_eq!(s.state, SandboxState::NotReady);
        let s = sandbox_of(api::PodSandbox { state: 0, ..Default::default() });
        assert_eq!(s.state, SandboxState::Ready);
    }

    #[test]
    fn long_messages_are_clipped() {
        let m = clip(&"x".repeat(5000));
        assert!(m.len() < 600 && m.ends_with("(5000 bytes)"), "{m}");
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn an_absent_socket_is_a_connect_error_naming_it() {
        let e = runtime()
            .block_on(Client::connect(Path::new("/nonexistent/aether-cri.sock"), Duration::from_secs(2)))
            .err()
            .unwrap();
        let text = e.to_string();
        assert!(matches!(e, Error::Connect { .. }) && text.contains("/nonexistent/aether-cri.sock"), "{text}");
    }

    /// A socket that answers garbage and hangs up: the same.
    #[test]
    fn a_socket_answering_garbage_and_closing_is_an_error_not_a_hang() {
        let dir = std::env::temp_dir().join(format!("aether-cri-garbage-close-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("garbage.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            use std::io::Write;
            for stream in listener.incoming().take(3) {
                let _ = stream.unwrap().write_all(b"HTTP/1.1 418 I'm a teapot\r\n\r\nnot gRPC\r\n");
            }
        });
        let rt = runtime();
        let started = std::time::Instant::now();
        for _ in 0..3 {
            let outcome = rt.block_on(async {
                let mut c = Client::connect(&path, Duration::from_secs(3)).await?;
                c.sandboxes().await
            });
            let e = outcome.expect_err("garbage is not a sandbox list");
            eprintln!("{e} after {:?}", started.elapsed());
            assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        }
        drop(server);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A socket that answers garbage instead of HTTP/2: the call fails, names the socket.
    #[test]
    fn a_socket_answering_garbage_is_an_error_not_a_hang() {
        let dir = std::env::temp_dir().join(format!("aether-cri-garbage-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("garbage.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            use std::io::{Read, Write};
            for stream in listener.incoming().take(1) {
                let mut s = stream.unwrap();
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello garbage garbage garbage");
                let mut buf = [0u8; 1024];
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = s.read(&mut buf);
            }
        });
        let rt = runtime();
        let outcome = rt.block_on(async {
            let mut c = Client::connect(&path, Duration::from_secs(3)).await?;
            c.sandboxes().await
        });
        let e = outcome.expect_err("garbage is not a sandbox list");
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        server.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
