//! A small blocking HTTP/1.1 client over `std::net::TcpStream` for the management API tests:
//! one request per connection (`Connection: close`), 10 s timeouts, basic auth.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// One answer.
#[derive(Debug)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Headers, names lowercased.
    pub headers: Vec<(String, String)>,
    /// Body as text.
    pub body: String,
}

impl Response {
    /// The body as JSON (panics with the body when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == &name.to_ascii_lowercase()).map(|(_, v)| v.as_str())
    }
}

/// Credentials of the default user.
pub const GUEST: Option<(&str, &str)> = Some(("guest", "guest"));

/// Sends `method path` with an optional JSON `body` and basic-auth `auth` to 127.0.0.1:`port`.
pub fn request(port: u16, method: &str, path: &str, body: Option<&str>, auth: Option<(&str, &str)>) -> Response {
    try_request(port, method, path, body, auth).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// [`request`], or why it failed.
pub fn try_request(port: u16, method: &str, path: &str, body: Option<&str>, auth: Option<(&str, &str)>) -> Result<Response, String> {
    try_request_with(port, method, path, body, auth, &[])
}

/// [`try_request`] with extra request headers.
pub fn try_request_with(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
    auth: Option<(&str, &str)>,
    headers: &[(&str, &str)],
) -> Result<Response, String> {
    use base64::Engine as _;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    if let Some((u, p)) = auth {
        head.push_str(&format!("Authorization: Basic {}\r\n", base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = body.unwrap_or("");
    head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len()));
    s.write_all(head.as_bytes()).and_then(|_| s.write_all(body.as_bytes())).map_err(|e| format!("write: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| format!("read: {e}"))?;
    parse(&raw)
}

/// Parses one raw HTTP/1.1 answer (status line, headers, body; chunked bodies decoded).
pub fn parse(raw: &[u8]) -> Result<Response, String> {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").ok_or_else(|| format!("no header end in {text:?}"))?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status in {head:?}"))?;
    let headers: Vec<(String, String)> =
        lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned())).collect();
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked { dechunk(rest) } else { rest.to_owned() };
    Ok(Response { status, headers, body })
}

/// Decodes a chunked body.
fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// GET as guest, expecting 200; the JSON body.
pub fn get_json(port: u16, path: &str) -> serde_json::Value {
    let r = request(port, "GET", path, None, GUEST);
    assert_eq!(r.status, 200, "GET {path}: {r:?}");
    r.json()
}

/// Polls `GET path` until `ok` holds on its JSON (at most 10 s); the last value.
pub fn wait_json(port: u16, path: &str, ok: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let v = get_json(port, path);
        if ok(&v) || std::time::Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `GET path` on 127.0.0.1:port with `Connection: close`; the response (headers and body), or
/// why not. Connect, write and read are each bounded to 5 s.
pub fn http_get(port: u16, path: &str) -> Result<String, String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes())
        .map_err(|e| format!("write request: {e}"))?;
    let mut out = Vec::new();
    let r = s.read_to_end(&mut out);
    if out.is_empty() {
        return Err(format!("no response from {addr}{path}: {r:?}"));
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Runs the `ringmqctl` binary against the management API on `port` with `args`: (exit code, stdout, stderr). Bounded: 30 s.
pub fn ringmqctl(port: u16, args: &[&str]) -> (i32, String, String) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ringmqctl"))
        .args(["--management", &format!("http://127.0.0.1:{port}"), "--timeout", "10"])
        .args(args)
        .env_remove("RINGMQCTL_USERNAME")
        .env_remove("RINGMQCTL_PASSWORD")
        .env_remove("RINGMQCTL_MANAGEMENT")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn ringmqctl");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("ringmqctl {args:?} did not finish in 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}
