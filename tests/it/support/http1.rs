//! A plain HTTP/1.0 client over one socket a request, as curl or a browser sends: an answer's status, headers and body, and a Server-Sent Events reader.
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// An HTTP answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON (panics, naming the answer, when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.status, self.body))
    }
}

/// A request: method, path and query, headers (Host is added), body.
pub struct Req<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub headers: Vec<(&'a str, String)>,
    pub body: Option<Vec<u8>>,
}

impl<'a> Req<'a> {
    pub fn new(method: &'a str, path: &'a str) -> Req<'a> {
        Req {
            method,
            path,
            headers: Vec::new(),
            body: None,
        }
    }

    pub fn bearer(mut self, token: &str) -> Self {
        self.headers
            .push(("Authorization", format!("Bearer {token}")));
        self
    }

    pub fn header(mut self, name: &'a str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    /// A JSON body, with `Content-Type: application/json`.
    pub fn json(mut self, body: &serde_json::Value) -> Self {
        self.headers
            .push(("Content-Type", "application/json".to_owned()));
        self.body = Some(body.to_string().into_bytes());
        self
    }

    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = Some(body.into());
        self
    }

    fn head(&self, addr: SocketAddr) -> Vec<u8> {
        let mut head = format!("{} {} HTTP/1.0\r\n", self.method, self.path);
        if !self
            .headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case("host"))
        {
            head.push_str(&format!("Host: {addr}\r\n"));
        }
        for (n, v) in &self.headers {
            head.push_str(&format!("{n}: {v}\r\n"));
        }
        if let Some(b) = &self.body {
            head.push_str(&format!("Content-Length: {}\r\n", b.len()));
        }
        head.push_str("\r\n");
        let mut bytes = head.into_bytes();
        if let Some(b) = &self.body {
            bytes.extend_from_slice(b);
        }
        bytes
    }

    /// Sends the request and reads the whole answer (within 30 s).
    pub async fn send(self, addr: SocketAddr) -> Answer {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(&self.head(addr)).await.expect("write");
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut raw))
            .await
            .expect("an answer within 30 s")
            .expect("read");
        parse(&raw)
    }

    /// Sends the request and answers the status and headers, and the rest to read as events.
    pub async fn events(self, addr: SocketAddr) -> (Answer, Events) {
        let s = TcpStream::connect(addr).await.expect("connect");
        let mut r = BufReader::new(s);
        r.get_mut()
            .write_all(&self.head(addr))
            .await
            .expect("write");
        let mut head = String::new();
        loop {
            let mut line = String::new();
            let n = tokio::time::timeout(Duration::from_secs(30), r.read_line(&mut line))
                .await
                .expect("a head within 30 s")
                .expect("read");
            if n == 0 || line == "\r\n" {
                break;
            }
            head.push_str(&line);
        }
        let mut answer = parse(head.as_bytes());
        if answer.status != 200 {
            let mut rest = String::new();
            let _ = r.read_to_string(&mut rest).await;
            answer.body = rest;
        }
        (answer, Events { r })
    }
}

fn parse(raw: &[u8]) -> Answer {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {text}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
        .collect();
    Answer {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// One Server-Sent Event.
#[derive(Debug, Clone, Default)]
pub struct Event {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
}

impl Event {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.data).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }
}

/// An event stream being read.
pub struct Events {
    r: BufReader<TcpStream>,
}

impl Events {
    /// The next event (comments skipped); `None` when the stream ends or `wait` passes.
    pub async fn next(&mut self, wait: Duration) -> Option<Event> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut e = Event::default();
        let mut any = false;
        loop {
            let mut line = String::new();
            let n = tokio::time::timeout_at(deadline, self.r.read_line(&mut line))
                .await
                .ok()?
                .ok()?;
            if n == 0 {
                return None;
            }
            let line = line.trim_end_matches(['\r', '\n']);
            if line.is_empty() {
                if any {
                    return Some(e);
                }
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (field, value) = line.split_once(": ").unwrap_or((line, ""));
            any = true;
            match field {
                "id" => e.id = Some(value.to_owned()),
                "event" => e.event = Some(value.to_owned()),
                "data" => e.data.push_str(value),
                _ => {}
            }
        }
    }

    /// The next event carrying records, skipping progress messages.
    pub async fn next_records(&mut self, wait: Duration) -> Option<Event> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let e = self.next(left).await?;
            if e.event.is_some()
                || e.json()["records"]
                    .as_array()
                    .is_some_and(|r| !r.is_empty())
            {
                return Some(e);
            }
        }
    }
}
