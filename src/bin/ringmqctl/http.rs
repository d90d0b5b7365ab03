//! The management API client: one blocking HTTP/1.1 request per call, HTTP basic auth,
//! JSON in and out (ureq). Errors carry the exit code the command ends with.

use std::time::Duration;

use base64::Engine as _;
use serde_json::Value;

/// Why a request failed, with the process exit code it maps to (see `--help`).
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// Bad command-line input that clap could not catch (exit 64, EX_USAGE).
    #[error("{0}")]
    Usage(String),
    /// A definitions file or JSON argument that does not parse, or a 400/406 from the
    /// server (exit 65, EX_DATAERR).
    #[error("{0}")]
    Data(String),
    /// A file to read is missing or unreadable (exit 66, EX_NOINPUT).
    #[error("{0}")]
    NoInput(String),
    /// The object the command names does not exist (404; exit 1).
    #[error("{0}")]
    NotFound(String),
    /// The management API could not be reached, timed out, or answered 503 (exit 69,
    /// EX_UNAVAILABLE).
    #[error("{0}")]
    Unavailable(String),
    /// 401 or 403: the credentials are wrong or lack the tag or permission (exit 77,
    /// EX_NOPERM).
    #[error("{0}")]
    NoPerm(String),
    /// Any other answer the command did not expect (exit 70, EX_SOFTWARE).
    #[error("{0}")]
    Software(String),
}

impl CtlError {
    /// The process exit code for this error (sysexits.h values, as rabbitmqctl uses them;
    /// 1 for "not found").
    pub fn exit_code(&self) -> i32 {
        match self {
            CtlError::NotFound(_) => 1,
            CtlError::Usage(_) => 64,
            CtlError::Data(_) => 65,
            CtlError::NoInput(_) => 66,
            CtlError::Unavailable(_) => 69,
            CtlError::Software(_) => 70,
            CtlError::NoPerm(_) => 77,
        }
    }
}

/// A management API endpoint with credentials.
pub struct Client {
    /// Base URL without a trailing slash, e.g. `http://127.0.0.1:15672`.
    base: String,
    /// The `Authorization` header value (`Basic …`).
    auth: String,
    agent: ureq::Agent,
}

impl Client {
    /// A client for `base` (an `http://host:port` URL; a trailing `/` is dropped) that
    /// logs in as `user`/`password`; each request gives up after `timeout`.
    pub fn new(base: &str, user: &str, password: &str, timeout: Duration) -> Client {
        let auth = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}")));
        let agent = ureq::AgentBuilder::new().timeout(timeout).build();
        Client { base: base.trim_end_matches('/').to_string(), auth, agent }
    }

    /// `GET path` (path starts with `/api/`): the JSON body.
    ///
    /// # Errors
    /// See [`CtlError`]; a body that is not JSON is `Software`.
    pub fn get(&self, path: &str) -> Result<Value, CtlError> {
        self.call("GET", path, None, &[])
    }

    /// `PUT path` with a JSON body; the answer's JSON body, or `Null` when empty.
    pub fn put(&self, path: &str, body: &Value) -> Result<Value, CtlError> {
        self.call("PUT", path, Some(body), &[])
    }

    /// `POST path` with a JSON body; the answer's JSON body, or `Null` when empty.
    pub fn post(&self, path: &str, body: &Value) -> Result<Value, CtlError> {
        self.call("POST", path, Some(body), &[])
    }

    /// `DELETE path` with extra request headers (e.g. `X-Reason`).
    pub fn delete(&self, path: &str, headers: &[(&str, &str)]) -> Result<Value, CtlError> {
        self.call("DELETE", path, None, headers)
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>, headers: &[(&str, &str)]) -> Result<Value, CtlError> {
        let url = format!("{}{path}", self.base);
        let mut req = self.agent.request(method, &url).set("Authorization", &self.auth);
        for (k, v) in headers {
            req = req.set(k, v);
        }
        let answer = match body {
            Some(b) => req.send_json(b.clone()),
            None => req.call(),
        };
        match answer {
            Ok(resp) => {
                let text = resp.into_string().map_err(|e| CtlError::Unavailable(format!("{method} {url}: reading the answer: {e}")))?;
                if text.trim().is_empty() {
                    return Ok(Value::Null);
                }
                serde_json::from_str(&text).map_err(|e| CtlError::Software(format!("{method} {url}: the answer is not JSON: {e}")))
            }
            Err(ureq::Error::Status(code, resp)) => {
                let text = resp.into_string().unwrap_or_default();
                Err(status_error(code, &text, path))
            }
            Err(ureq::Error::Transport(t)) => Err(CtlError::Unavailable(format!("cannot reach the management API at {}: {t}", self.base))),
        }
    }
}

/// The error for an HTTP status `code` with body `text` to a request for `path`: the server's
/// `reason` (RabbitMQ's error shape `{"error": …, "reason": …}`) when it gives one; a 404
/// names the object that `path` addresses ("queue 'jobs' in vhost '/' not found").
fn status_error(code: u16, text: &str, path: &str) -> CtlError {
    let reason = serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| v.get("reason").or_else(|| v.get("error")).and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| text.trim().to_string());
    let reason = match (code, object_of(path)) {
        (404, Some(object)) => format!("{object} not found"),
        _ => reason,
    };
    let msg = if reason.is_empty() { format!("the management API answered {code}") } else { format!("{code}: {reason}") };
    match code {
        401 | 403 => CtlError::NoPerm(msg),
        404 => CtlError::NotFound(msg),
        400 | 406 | 409 | 415 | 422 => CtlError::Data(msg),
        503 => CtlError::Unavailable(msg),
        _ => CtlError::Software(msg),
    }
}

/// The object an API path names, in words: `/api/queues/%2F/jobs` → "queue 'jobs' in vhost
/// '/'"; None for a path that names no single object.
fn object_of(path: &str) -> Option<String> {
    let path = path.split('?').next()?;
    let parts: Vec<String> =
        path.strip_prefix("/api/")?.split('/').map(|p| percent_encoding::percent_decode_str(p).decode_utf8_lossy().into_owned()).collect();
    let kind = |plural: &str| match plural {
        "queues" => Some("queue"),
        "exchanges" => Some("exchange"),
        "policies" => Some("policy"),
        "operator-policies" => Some("operator policy"),
        _ => None,
    };
    match parts.as_slice() {
        [k, vhost, name, ..] if kind(k).is_some() && !name.is_empty() => Some(format!("{} '{name}' in vhost '{vhost}'", kind(k)?)),
        [k, vhost] if kind(k).is_some() => Some(format!("vhost '{vhost}'")),
        [k, name] if k == "users" => Some(format!("user '{name}'")),
        [k, name] if k == "vhosts" => Some(format!("vhost '{name}'")),
        [k, name] if k == "connections" => Some(format!("connection '{name}'")),
        [k, vhost, user] if k == "permissions" => Some(format!("permissions of user '{user}' in vhost '{vhost}'")),
        [k, name, ..] if k == "nodes" => Some(format!("node '{name}'")),
        _ => None,
    }
}

/// `s` as one path segment: every byte but RFC 3986's unreserved ones percent-encoded
/// (`/` → `%2F`, so the default vhost is `%2F`).
pub fn seg(s: &str) -> String {
    const RESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');
    percent_encoding::utf8_percent_encode(s, RESERVED).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_encode_the_default_vhost_and_spaces() {
        assert_eq!(seg("/"), "%2F");
        assert_eq!(seg("my queue/é"), "my%20queue%2F%C3%A9");
        assert_eq!(seg("a-b.c_d~e"), "a-b.c_d~e");
    }

    #[test]
    fn statuses_map_to_exit_codes() {
        let not_found = r#"{"error":"Object Not Found","reason":"Not Found"}"#;
        let e = status_error(404, not_found, "/api/queues/%2F/jobs");
        assert_eq!((e.exit_code(), e.to_string()), (1, "404: queue 'jobs' in vhost '/' not found".to_string()));
        assert_eq!(status_error(404, not_found, "/api/users/bob").to_string(), "404: user 'bob' not found");
        assert_eq!(status_error(404, not_found, "/api/queues/staging").to_string(), "404: vhost 'staging' not found");
        assert_eq!(status_error(404, not_found, "/api/overview").to_string(), "404: Not Found");
        assert_eq!(status_error(401, "", "/api/overview").exit_code(), 77);
        assert_eq!(status_error(400, r#"{"error":"bad_request","reason":"x"}"#, "/api/queues").exit_code(), 65);
        assert_eq!(status_error(503, "", "/api/overview").exit_code(), 69);
        assert_eq!(status_error(500, "boom", "/api/overview").to_string(), "500: boom");
    }
}
