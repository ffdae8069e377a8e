//! The client of the installer's Service layer socket: one blocking HTTP/1.1 `POST` of a
//! document to [`APPLY_PATH`] over a unix stream, the answer read to its end. The CLI
//! (`aether-cni services apply --socket`) runs it in a fresh process on every call, so it
//! starts no async runtime; the answer's head is parsed by `httparse`, the request is one
//! line of headers. The path and the server's deadline are here so that the server
//! (aether-installer) and its client share them.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// The only path the socket serves.
pub const APPLY_PATH: &str = "/services/apply";
/// How long the socket gives a document to be read and to wait for its turn behind the
/// document being applied; then 503. The apply itself is not bounded by it: the answer comes
/// when the apply is done.
pub const WAIT_DEADLINE: Duration = Duration::from_secs(120);

/// Headers an answer may have: the installer sends four.
const MAX_HEADERS: usize = 32;

/// `POST` `body` to the socket at `socket`: the answer's status and body, or why there is
/// none (the message says the document may or may not have been applied once it was sent).
pub fn post_apply(socket: &Path, body: &[u8], timeout: Duration) -> Result<(u16, Vec<u8>), String> {
    let mut s = UnixStream::connect(socket)
        .map_err(|e| format!("cannot connect to the installer's socket {}: {e}", socket.display()))?;
    s.set_read_timeout(Some(timeout)).and_then(|_| s.set_write_timeout(Some(timeout))).map_err(|e| e.to_string())?;
    let head = format!(
        "POST {APPLY_PATH} HTTP/1.1\r\nHost: aether-cni\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let sent = s.write_all(head.as_bytes()).and_then(|_| s.write_all(body));
    // The installer may answer before it read everything (413): its answer is still there.
    let mut text = Vec::new();
    let read = s.read_to_end(&mut text);
    let lost = |what: &str| {
        format!(
            "{what} from the installer's socket {}; the document may or may not have been applied",
            socket.display()
        )
    };
    if text.is_empty() {
        let why = read.err().or(sent.err()).map_or("the connection was closed".into(), |e| e.to_string());
        return Err(lost(&format!("no answer ({why})")));
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut answer = httparse::Response::new(&mut headers);
    let head_len = match answer.parse(&text) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Err(lost("a truncated answer")),
        Err(_) => return Err(lost("an answer that is not HTTP")),
    };
    let status = answer.code.ok_or_else(|| lost("an answer that is not HTTP"))?;
    let length = answer
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .and_then(|h| std::str::from_utf8(h.value).ok()?.trim().parse::<usize>().ok());
    let body = text.split_off(head_len);
    if length.is_some_and(|n| n != body.len()) {
        return Err(lost("a truncated answer"));
    }
    Ok((status, body))
}
