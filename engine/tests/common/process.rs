//! The engine binary as a process: `serve` on a free loopback port (`--port 0`; the address
//! it prints is read back), ready when `/ready` answers 200, killed when dropped.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub struct EngineProcess {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub base: String,
    /// Every line the process printed on stdout and stderr so far.
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

/// How long start-up (model load) and exits may take on a loaded machine.
const START: Duration = Duration::from_secs(120);
/// How often the conditions waited on are looked at.
const POLL: Duration = Duration::from_millis(20);

impl EngineProcess {
    /// `dspark-engine serve --model MODEL --host 127.0.0.1 --port 0` plus `args`, started
    /// and ready.
    pub fn serve(model: &std::path::Path, args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dspark-engine"))
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the engine binary");
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        let keep = |log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
                    tx: Option<std::sync::mpsc::Sender<String>>,
                    r: Box<dyn std::io::Read + Send>| {
            std::thread::spawn(move || {
                for line in BufReader::new(r).lines().map_while(Result::ok) {
                    // "... | http://ADDR[ | admin http://ADDR]": the API's address.
                    if let (Some(tx), Some(at)) = (&tx, line.find("| http://")) {
                        let url = line[at + 2..].split_whitespace().next().unwrap_or("");
                        let _ = tx.send(url.to_string());
                    }
                    log.lock().unwrap().push(line);
                }
            })
        };
        keep(log.clone(), Some(tx), Box::new(out));
        keep(log.clone(), None, Box::new(err));
        let mut p = Self {
            child,
            base: String::new(),
            log,
        };
        match rx.recv_timeout(START) {
            Ok(base) => p.base = base,
            Err(_) => panic!(
                "the engine printed no address within {START:?}:\n{}",
                p.log_text()
            ),
        }
        p.wait_for("/ready to answer 200", START, |p| {
            p.status("/ready") == Some(200)
        });
        p
    }

    /// The status of a GET of `path` (None when the server does not answer).
    pub fn status(&self, path: &str) -> Option<u16> {
        reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap()
            .get(format!("{}{path}", self.base))
            .send()
            .ok()
            .map(|r| r.status().as_u16())
    }

    /// Waits until `cond` holds (panics with the log after `limit`).
    pub fn wait_for(&mut self, what: &str, limit: Duration, cond: impl Fn(&mut Self) -> bool) {
        let t = Instant::now();
        while !cond(self) {
            if let Ok(Some(s)) = self.child.try_wait() {
                panic!(
                    "the engine exited ({s}) while waiting for {what}:\n{}",
                    self.log_text()
                );
            }
            assert!(
                t.elapsed() < limit,
                "{what}: not within {limit:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(POLL);
        }
    }

    /// Sends SIGTERM (what Kubernetes sends a pod it stops).
    pub fn sigterm(&self) {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        let r = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(r, 0, "kill -TERM {}", self.child.id());
    }

    /// Waits for the process to exit (panics with the log after `limit`).
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                t.elapsed() < limit,
                "the engine did not exit within {limit:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(POLL);
        }
    }

    /// What the process printed so far.
    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
