//! The forward's own thread pool: N - 1 persistent workers plus the calling thread, for the
//! many short parallel regions of one model step (q/k/v, attention, o, gate/up, down, per
//! layer: ~150 regions of 5-50 us each for a decode step).
//!
//! A general pool (rayon) parks idle workers on a futex and the caller blocks on a latch, so
//! every region pays two wake-ups through the kernel scheduler; on a small model that was
//! ~30 % of a decode step. Here the caller publishes a job and works on it too, and workers
//! spin on the job slot for a while after each job (`SPIN`) before they park, so the next
//! region of the same step starts without any system call. Between steps (or when idle) the
//! workers park and cost nothing.
//!
//! One job at a time: a second caller while a job runs (tests on several threads) runs its
//! tasks itself.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(300);

struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    tasks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    /// A task panicked (on any thread); the caller re-raises it after the job.
    panicked: AtomicBool,
}

struct Shared {
    /// The running job (a `Job` on the caller's stack) or null.
    job: AtomicPtr<Job<'static>>,
    /// Bumped for every job; workers wait for it to change.
    generation: AtomicU64,
    /// Workers inside a job (the caller waits for 0 before its `Job` goes away).
    active: AtomicUsize,
    sleeping: Vec<AtomicBool>,
    threads: Mutex<Vec<Thread>>,
}

pub struct Pool {
    shared: Arc<Shared>,
    busy: Mutex<()>,
    size: usize,
}

impl Pool {
    /// A pool of `size` threads in all (the caller is one of them).
    pub fn new(size: usize) -> Self {
        let size = size.max(1);
        let shared = Arc::new(Shared {
            job: AtomicPtr::new(std::ptr::null_mut()),
            generation: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            sleeping: (1..size).map(|_| AtomicBool::new(false)).collect(),
            threads: Mutex::new(Vec::new()),
        });
        for w in 0..size - 1 {
            let s = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("dspark-kernel-{w}"))
                .spawn(move || worker(&s, w))
                .expect("spawn kernel worker");
            shared.threads.lock().unwrap().push(h.thread().clone());
        }
        Self {
            shared,
            busy: Mutex::new(()),
            size,
        }
    }

    /// Threads in all, the caller included.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Calls `f(i)` for every `i < tasks`, spread over the pool; returns when all are done.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        let guard = match self.busy.try_lock() {
            Ok(g) if tasks > 1 && self.size > 1 => g,
            _ => {
                (0..tasks).for_each(f);
                return;
            }
        };
        let job = Job {
            f,
            tasks,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        };
        // SAFETY (lifetime): the pointer is withdrawn and every worker has left the job
        // (`active == 0`) before this function returns, so `job` outlives all uses.
        let ptr = &job as *const Job as *mut Job<'static>;
        let s = &*self.shared;
        s.job.store(ptr, SeqCst);
        s.generation.fetch_add(1, SeqCst);
        let threads = s.threads.lock().unwrap_or_else(|e| e.into_inner());
        for (i, sl) in s.sleeping.iter().enumerate() {
            if sl.swap(false, SeqCst) {
                threads[i].unpark();
            }
        }
        drop(threads);
        work(&job);
        wait_until(|| job.done.load(SeqCst) >= tasks);
        s.job.store(std::ptr::null_mut(), SeqCst);
        wait_until(|| s.active.load(SeqCst) == 0);
        drop(guard);
        if job.panicked.load(SeqCst) {
            panic!("a task of a kernel-pool job panicked");
        }
    }
}

/// Spins until `cond`, yielding the core now and then (a preempted worker that holds a
/// task must get to run on a busy machine).
fn wait_until(cond: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !cond() {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(256) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

fn work(job: &Job) {
    loop {
        let i = job.next.fetch_add(1, SeqCst);
        if i >= job.tasks {
            return;
        }
        // A panicking task must still count as done, or the caller would wait forever (and
        // a worker thread must survive it).
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (job.f)(i))).is_err() {
            job.panicked.store(true, SeqCst);
        }
        job.done.fetch_add(1, SeqCst);
    }
}

fn worker(s: &Shared, me: usize) {
    let mut seen = s.generation.load(SeqCst);
    loop {
        // Wait for a new job: spin, then park.
        let t0 = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.generation.load(SeqCst) != seen {
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) {
                std::thread::yield_now();
            }
            if spins.is_multiple_of(64) && t0.elapsed() > SPIN {
                s.sleeping[me].store(true, SeqCst);
                if s.generation.load(SeqCst) == seen {
                    std::thread::park();
                }
                s.sleeping[me].store(false, SeqCst);
                continue;
            }
            std::hint::spin_loop();
        }
        seen = s.generation.load(SeqCst);
        s.active.fetch_add(1, SeqCst);
        let p = s.job.load(SeqCst);
        if !p.is_null() {
            // SAFETY: the caller keeps the job alive while `active > 0` (see `Pool::run`), and
            // it was still published after we registered as active.
            work(unsafe { &*p });
        }
        s.active.fetch_sub(1, SeqCst);
    }
}

/// A pointer into one buffer that parallel tasks share, each writing its own disjoint part.
pub struct SharedMut<T>(*mut T);
// SAFETY: users promise disjoint writes (see `slice`).
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}
impl<T> Clone for SharedMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub fn new(buf: &mut [T]) -> Self {
        Self(buf.as_mut_ptr())
    }

    /// The buffer's start, for writes the caller keeps disjoint.
    pub fn ptr(&self) -> *mut T {
        self.0
    }

    /// `len` elements from `start`.
    ///
    /// # Safety
    /// The range lies inside the buffer, the buffer outlives the slice, and no other task
    /// touches the range meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }
}

/// The process-wide pool, sized by [`set_threads`] (or the cores) on first use.
pub fn global() -> &'static Pool {
    GLOBAL.get_or_init(|| Pool::new(*THREADS.get_or_init(default_threads)))
}

static GLOBAL: OnceLock<Pool> = OnceLock::new();
static THREADS: OnceLock<usize> = OnceLock::new();

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Sets the global pool's size; only before its first use (later calls are ignored).
pub fn set_threads(n: usize) {
    let _ = THREADS.set(n.max(1));
}

/// Runs `f(i)` for `i < tasks` on the global pool.
pub fn run(tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    global().run(tasks, f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_survives() {
        let pool = Pool::new(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(8, &|i| assert!(i != 5, "task 5 fails"))
        }));
        assert!(r.is_err());
        let hits: Vec<AtomicUsize> = (0..8).map(|_| AtomicUsize::new(0)).collect();
        pool.run(8, &|i| {
            hits[i].fetch_add(1, SeqCst);
        });
        assert!(hits.iter().all(|h| h.load(SeqCst) == 1));
    }

    #[test]
    fn every_task_runs_once_across_many_jobs_and_callers() {
        let pool = Arc::new(Pool::new(3));
        let handles: Vec<_> = (0..3)
            .map(|c| {
                let pool = pool.clone();
                std::thread::spawn(move || {
                    for j in 0..300 {
                        let tasks = (j * 7 + c) % 37;
                        let hits: Vec<AtomicUsize> =
                            (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                        pool.run(tasks, &|i| {
                            hits[i].fetch_add(1, SeqCst);
                        });
                        assert!(hits.iter().all(|h| h.load(SeqCst) == 1));
                        if j % 100 == 99 {
                            // Long enough for the workers to park.
                            std::thread::sleep(Duration::from_millis(2));
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }
}
