//! Container logs as a kubelet keeps them: every line a container writes to stdout or stderr,
//! with its time and stream, CRI style (`2026-12-01T07:23:40.116656Z stdout F text`; a line
//! longer than 16 KiB is cut into `P`artial pieces and a `F`ull last one), in
//! `<pod dir>/<container>.log` for the running instance and `<container>.previous.log` for the
//! one before it; and reading them back as `kubectl logs` asks (`tailLines`, `sinceSeconds`,
//! `sinceTime`, `limitBytes`, `timestamps`, `stream`, `previous`, `follow`).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt as _, AsyncRead, BufReader};
use tokio::sync::watch;

/// Longest piece of a line kept as one log line.
pub const MAX_LINE: usize = 16 * 1024;

/// The log of a container's running instance in its pod's folder.
pub fn current(pod_dir: &Path, container: &str) -> PathBuf {
    pod_dir.join(format!("{container}.log"))
}

/// The log of the instance before it.
pub fn previous(pod_dir: &Path, container: &str) -> PathBuf {
    pod_dir.join(format!("{container}.previous.log"))
}

/// Which output a line came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

impl Stream {
    fn as_str(self) -> &'static str {
        match self {
            Self::Stdout => "stdout",
            Self::Stderr => "stderr",
        }
    }
}

/// The log of a container instance that is about to start.
#[derive(Debug)]
pub struct LogFile(Arc<Mutex<std::fs::File>>);

impl LogFile {
    /// Opens the log of a new instance of `container`: the log of the one before becomes its
    /// previous log.
    pub fn open(pod_dir: &Path, container: &str) -> std::io::Result<Self> {
        let path = current(pod_dir, container);
        if path.exists() {
            std::fs::rename(&path, previous(pod_dir, container))?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        Ok(Self(Arc::new(Mutex::new(file))))
    }

    /// Copies `stdout` and `stderr` into it line by line (the file stays open: a late line of
    /// an instance that ended goes to its own log). The returned receiver turns true once both
    /// have ended.
    pub fn record(
        self,
        stdout: impl AsyncRead + Unpin + Send + 'static,
        stderr: impl AsyncRead + Unpin + Send + 'static,
    ) -> watch::Receiver<bool> {
        let (done, ended) = watch::channel(false);
        let out = tokio::spawn(copy_lines(Stream::Stdout, stdout, Arc::clone(&self.0)));
        let err = tokio::spawn(copy_lines(Stream::Stderr, stderr, self.0));
        tokio::spawn(async move {
            let _ = out.await;
            let _ = err.await;
            done.send_replace(true);
        });
        ended
    }
}

/// Copies one stream into the log, one CRI line per line (pieces of at most [`MAX_LINE`]).
async fn copy_lines(
    stream: Stream,
    reader: impl AsyncRead + Unpin,
    file: Arc<Mutex<std::fs::File>>,
) {
    let mut reader = BufReader::with_capacity(MAX_LINE, reader);
    let mut line = Vec::new();
    let write = |text: &[u8], full: bool| {
        let entry = format!(
            "{} {} {} {}\n",
            Timestamp::now(),
            stream.as_str(),
            if full { "F" } else { "P" },
            String::from_utf8_lossy(text)
        );
        if let Err(e) = file.lock().write_all(entry.as_bytes()) {
            tracing::warn!(error = %e, "cannot write a container log line");
        }
    };
    loop {
        let buf = match reader.fill_buf().await {
            Ok(buf) if !buf.is_empty() => buf,
            _ => break,
        };
        let room = MAX_LINE - line.len();
        match buf.iter().position(|b| *b == b'\n') {
            Some(end) if end <= room => {
                line.extend_from_slice(&buf[..end]);
                reader.consume(end + 1);
                write(&line, true);
                line.clear();
            }
            _ => {
                let n = buf.len().min(room);
                line.extend_from_slice(&buf[..n]);
                reader.consume(n);
                if line.len() == MAX_LINE {
                    write(&line, false);
                    line.clear();
                }
            }
        }
    }
    if !line.is_empty() {
        write(&line, true);
    }
}

/// One line of a log file.
#[derive(Clone, Debug, PartialEq)]
pub struct Line<'a> {
    /// When it was written.
    pub time: Timestamp,
    /// Where from.
    pub stream: Stream,
    /// Whether the container's line ends here (false: it goes on in the next one).
    pub full: bool,
    /// What was written.
    pub text: &'a str,
}

impl<'a> Line<'a> {
    /// Parses a CRI log line (without its newline); `None` for anything else.
    pub fn parse(line: &'a str) -> Option<Self> {
        let mut parts = line.splitn(4, ' ');
        let time = parts.next()?.parse().ok()?;
        let stream = match parts.next()? {
            "stdout" => Stream::Stdout,
            "stderr" => Stream::Stderr,
            _ => return None,
        };
        let full = match parts.next()? {
            "F" => true,
            "P" => false,
            _ => return None,
        };
        Some(Self {
            time,
            stream,
            full,
            text: parts.next().unwrap_or_default(),
        })
    }
}

/// What `kubectl logs` asked for (the kubelet API's `containerLogs` query).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Query {
    /// Keep the response open and send lines as they are written, until the container ends.
    pub follow: bool,
    /// The instance before the running one.
    pub previous: bool,
    /// Prefix each line with its time.
    pub timestamps: bool,
    /// Only the last this many lines.
    pub tail_lines: Option<usize>,
    /// Stop after this many bytes.
    pub limit_bytes: Option<u64>,
    /// Only lines written at or after this.
    pub since: Option<Timestamp>,
    /// Only this stream (`None`: both).
    pub stream: Option<Stream>,
}

impl Query {
    /// Parses the query string of a `containerLogs` request at `now` (for `sinceSeconds`).
    pub fn parse(query: &str, now: Timestamp) -> Result<Self, String> {
        let mut q = Self::default();
        for (key, value) in form_urlencoded::parse(query.as_bytes()) {
            let number = |v: &str| -> Result<i64, String> {
                v.parse::<i64>()
                    .ok()
                    .filter(|n| *n >= 0)
                    .ok_or_else(|| format!("{key} must be a number ≥ 0, got {v:?}"))
            };
            let flag = |v: &str| -> Result<bool, String> {
                match v {
                    "" | "true" | "1" => Ok(true),
                    "false" | "0" => Ok(false),
                    _ => Err(format!("{key} must be true or false, got {v:?}")),
                }
            };
            match key.as_ref() {
                "follow" => q.follow = flag(&value)?,
                "previous" => q.previous = flag(&value)?,
                "timestamps" => q.timestamps = flag(&value)?,
                "tailLines" => q.tail_lines = Some(number(&value)? as usize),
                "limitBytes" => q.limit_bytes = Some(number(&value)?.max(1) as u64),
                "sinceSeconds" => {
                    let back = SignedDuration::from_secs(number(&value)?);
                    q.since = now.checked_sub(back).ok();
                }
                "sinceTime" => {
                    q.since = Some(
                        value
                            .parse()
                            .map_err(|e| format!("sinceTime {value:?}: {e}"))?,
                    );
                }
                "stream" => {
                    q.stream = match value.as_ref() {
                        "All" | "" => None,
                        "Stdout" => Some(Stream::Stdout),
                        "Stderr" => Some(Stream::Stderr),
                        other => return Err(format!("unknown stream {other:?}")),
                    }
                }
                // Options of other log sources; nothing here to choose.
                _ => {}
            }
        }
        Ok(q)
    }

    /// A line as the response carries it, or `None` when the query leaves it out.
    pub fn render(&self, line: &Line<'_>) -> Option<String> {
        if self.stream.is_some_and(|s| s != line.stream)
            || self.since.is_some_and(|t| line.time < t)
        {
            return None;
        }
        let mut out = String::with_capacity(line.text.len() + 40);
        if self.timestamps {
            out.push_str(&line.time.to_string());
            out.push(' ');
        }
        out.push_str(line.text);
        if line.full {
            out.push('\n');
        }
        Some(out)
    }

    /// The response for a log's text as it is now: its lines that pass, the last `tailLines`
    /// of them, at most `limitBytes`.
    pub fn render_all(&self, text: &str) -> String {
        let lines: Vec<String> = text
            .lines()
            .filter_map(Line::parse)
            .filter_map(|l| self.render(&l))
            .collect();
        let from = self.tail_lines.map_or(0, |n| lines.len().saturating_sub(n));
        let mut out = lines[from..].concat();
        if let Some(limit) = self.limit_bytes {
            truncate_at_char(&mut out, limit as usize);
        }
        out
    }
}

/// Cuts `s` to at most `max` bytes, on a character boundary.
pub fn truncate_at_char(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    const LOG: &str = "\
2027-01-15T08:00:00Z stdout F starting
2027-01-15T08:00:01Z stderr F warning: slow
2027-01-15T08:00:02Z stdout P half a
2027-01-15T08:00:02Z stdout F  line
2027-01-15T08:00:03Z stdout F ready
";

    #[test]
    fn lines_come_back_as_written_or_filtered_as_asked() {
        let all = Query::default();
        assert_eq!(
            all.render_all(LOG),
            "starting\nwarning: slow\nhalf a line\nready\n"
        );
        let q = Query {
            tail_lines: Some(2),
            ..Query::default()
        };
        assert_eq!(
            q.render_all(LOG),
            " line\nready\n",
            "the last two lines of the file"
        );
        let q = Query {
            stream: Some(Stream::Stderr),
            timestamps: true,
            ..Query::default()
        };
        assert_eq!(q.render_all(LOG), "2027-01-15T08:00:01Z warning: slow\n");
        let q = Query {
            since: Some("2027-01-15T08:00:02Z".parse().unwrap()),
            limit_bytes: Some(8),
            ..Query::default()
        };
        assert_eq!(q.render_all(LOG), "half a l");
        assert_eq!(Line::parse("not a log line"), None);
    }

    #[test]
    fn queries_parse_as_the_apiserver_sends_them() {
        let q = Query::parse(
            "follow=true&previous=true&timestamps=true&tailLines=10&limitBytes=500&stream=Stdout",
            at(0),
        )
        .unwrap();
        assert_eq!(
            q,
            Query {
                follow: true,
                previous: true,
                timestamps: true,
                tail_lines: Some(10),
                limit_bytes: Some(500),
                since: None,
                stream: Some(Stream::Stdout),
            }
        );
        assert_eq!(
            Query::parse("sinceSeconds=60", at(100)).unwrap().since,
            Some(at(40))
        );
        assert_eq!(
            Query::parse("sinceTime=2027-01-15T08%3A00%3A02Z", at(0))
                .unwrap()
                .since,
            Some("2027-01-15T08:00:02Z".parse().unwrap())
        );
        assert!(Query::parse("tailLines=-1", at(0)).is_err());
        assert!(Query::parse("stream=Both", at(0)).is_err());
        assert!(Query::parse("follow=maybe", at(0)).is_err());
    }

    #[tokio::test]
    async fn an_instance_is_recorded_line_by_line_and_the_one_before_kept() {
        let dir = tempfile::tempdir().unwrap();
        let record_once = |out: &'static [u8], err: &'static [u8]| {
            LogFile::open(dir.path(), "app").unwrap().record(out, err)
        };
        let mut done = record_once(b"first run\n", b"");
        done.wait_for(|d| *d).await.unwrap();
        let long = vec![b'x'; MAX_LINE + 10];
        let long: &'static [u8] = Box::leak(
            [&long[..], b"\ntail without newline"]
                .concat()
                .into_boxed_slice(),
        );
        let mut done = record_once(long, b"oops\n");
        done.wait_for(|d| *d).await.unwrap();

        let previous = std::fs::read_to_string(previous(dir.path(), "app")).unwrap();
        assert_eq!(Query::default().render_all(&previous), "first run\n");
        let current = std::fs::read_to_string(current(dir.path(), "app")).unwrap();
        let lines: Vec<Line<'_>> = current.lines().filter_map(Line::parse).collect();
        assert_eq!(lines.len(), 4, "{current}");
        let out: Vec<_> = lines
            .iter()
            .filter(|l| l.stream == Stream::Stdout)
            .collect();
        assert_eq!(
            (
                out[0].full,
                out[0].text.len(),
                out[1].full,
                out[1].text.len()
            ),
            (false, MAX_LINE, true, 10),
            "a long line in pieces"
        );
        assert_eq!((out[2].full, out[2].text), (true, "tail without newline"));
        let q = Query {
            stream: Some(Stream::Stderr),
            ..Query::default()
        };
        assert_eq!(q.render_all(&current), "oops\n");
    }
}
