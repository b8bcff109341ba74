//! Child processes that never outlive the test process.
//!
//! Every component is spawned from one long-lived thread with `PR_SET_PDEATHSIG = SIGKILL`:
//! the kernel kills the child when that thread dies, which only happens when the whole
//! test process exits, even by `kill -9`. (The signal follows the spawning *thread*, so
//! spawning from a short-lived test thread would kill the child when that test returns.)
//! Orderly stops go through [`Process::stop`], which signals the stored PID, never a name.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

fn spawner() -> &'static mpsc::Sender<SpawnRequest> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnRequest>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("controlplane-spawner".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
                // The sender lives in a static, so this loop only ends with the process.
            })
            .expect("spawn the controlplane-spawner thread");
        tx
    })
}

/// Spawns `command` so that it is SIGKILLed when this process dies.
pub fn spawn_tied_to_this_process(mut command: Command) -> std::io::Result<Child> {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe libc calls between fork and exec.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before prctl took effect.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let (tx, rx) = mpsc::channel();
    spawner().send((command, tx)).map_err(|_| std::io::Error::other("spawner thread is gone"))?;
    rx.recv().map_err(|_| std::io::Error::other("spawner thread is gone"))?
}

/// One server process with its log file.
pub struct Process {
    pub name: &'static str,
    pub log_path: PathBuf,
    child: Child,
}

impl Process {
    /// Starts `program args…` with stdout and stderr appended to `log_path`.
    pub fn start(name: &'static str, program: &Path, args: &[String], log_path: &Path) -> Result<Self> {
        let mut command = Command::new(program);
        command.args(args);
        Self::start_command(name, command, log_path)
    }

    /// Starts `command` as it is set up (program, arguments, environment, user), with stdout
    /// and stderr appended to `log_path`.
    pub fn start_command(name: &'static str, mut command: Command, log_path: &Path) -> Result<Self> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(log_path)
            .with_context(|| format!("{name}: cannot open log file {}", log_path.display()))?;
        let program = command.get_program().to_owned();
        command.stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        let child = spawn_tied_to_this_process(command)
            .with_context(|| format!("{name}: cannot start {}", program.to_string_lossy()))?;
        Ok(Self { name, log_path: log_path.to_owned(), child })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// A one-line error naming the component and its log, with the log's tail on stderr.
    pub fn failure(&self, what: &str) -> anyhow::Error {
        eprintln!("---- last lines of {} ----\n{}\n----", self.log_path.display(), tail(&self.log_path, 25));
        anyhow!("{}: {what} (log: {})", self.name, self.log_path.display())
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`. Returns how it exited.
    pub fn stop(&mut self, grace: Duration) -> Option<ExitStatus> {
        if let Some(status) = self.exited() {
            return Some(status);
        }
        // SAFETY: plain kill(2) on the PID of a child we have not yet reaped.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Some(status) = self.exited() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        self.child.wait().ok()
    }

    /// Sends `signal` (for example SIGSTOP or SIGCONT) to the process.
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: as in `stop`.
        unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.stop(Duration::from_secs(5));
    }
}

/// The last `lines` lines of a file, for error reports.
pub fn tail(path: &Path, lines: usize) -> String {
    let Ok(mut file) = File::open(path) else {
        return String::from("(no log)");
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(16 * 1024)));
    let mut bytes = Vec::new();
    let _ = file.read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
