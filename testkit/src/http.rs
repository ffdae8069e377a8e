//! The tests' side of the installer's HTTP faces (probes, metrics, the agent's socket): one
//! request per connection, `Connection: close`, the answer read to its end. Spoken by hand on
//! purpose: the tests must see exactly what goes on the wire (a stalled head, a body over the
//! cap), which a client library would hide or refuse to send.

use std::io::{Read, Write};
use std::time::Duration;

/// Sends one request on `stream` (head and body in one write, as a client does: a server that
/// answers from the head alone may close before a second write) and reads the answer to its
/// end: (status, body). A status that cannot be read is 0.
pub fn exchange<S: Read + Write>(
    mut stream: S,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> std::io::Result<(u16, String)> {
    let mut request = match body {
        Some(body) => format!(
            "{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes(),
        None => format!("{method} {path} HTTP/1.0\r\nHost: t\r\n\r\n").into_bytes(),
    };
    request.extend_from_slice(body.unwrap_or_default());
    stream.write_all(&request)?;
    read_answer(stream)
}

/// Reads an answer to its end: (status, body); a status that cannot be read is 0.
pub fn read_answer(mut stream: impl Read) -> std::io::Result<(u16, String)> {
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    Ok(split(&text))
}

/// An answer's status (0 if it has none) and body.
pub fn split(text: &str) -> (u16, String) {
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

/// `GET path` on a TCP address: (status, body), or `None` when nothing answers there.
pub fn get(addr: impl std::net::ToSocketAddrs, path: &str) -> Option<(u16, String)> {
    let addr = addr.to_socket_addrs().ok()?.next()?;
    let stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    exchange(stream, "GET", path, None).ok()
}

/// The value of `series` (its name and labels exactly as exposed) in a Prometheus text
/// exposition.
pub fn metric(exposition: &str, series: &str) -> Option<f64> {
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_splits_into_status_and_body() {
        assert_eq!(split("HTTP/1.1 507 Insufficient Storage\r\na: b\r\n\r\n{\"x\":1}"), (507, "{\"x\":1}".into()));
        assert_eq!(split(""), (0, String::new()), "no answer: no status");
    }

    #[test]
    fn a_series_is_found_by_its_whole_name() {
        let text = "# HELP a_total x\na_total{kind=\"x\"} 3\na_total 7\na_totally 9\n";
        assert_eq!(metric(text, "a_total"), Some(7.0));
        assert_eq!(metric(text, "a_total{kind=\"x\"}"), Some(3.0));
        assert_eq!(metric(text, "a_tot"), None, "a prefix of a name is not the series");
    }

    #[test]
    fn a_request_goes_in_one_write_with_its_length() {
        struct Wire(Vec<Vec<u8>>, std::io::Cursor<Vec<u8>>);
        impl Write for Wire {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.push(b.to_vec());
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        impl Read for Wire {
            fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
                self.1.read(b)
            }
        }
        let mut wire = Wire(Vec::new(), std::io::Cursor::new(b"HTTP/1.1 200 OK\r\n\r\nok".to_vec()));
        assert_eq!(exchange(&mut wire, "POST", "/services/apply", Some(b"{}")).unwrap(), (200, "ok".into()));
        assert_eq!(wire.0.len(), 1);
        let sent = String::from_utf8(wire.0.remove(0)).unwrap();
        assert!(sent.starts_with("POST /services/apply HTTP/1.1\r\n") && sent.contains("Content-Length: 2\r\n"));
        assert!(sent.ends_with("\r\n\r\n{}"), "{sent}");
    }
}
