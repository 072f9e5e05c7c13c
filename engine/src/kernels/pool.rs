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
//!
//! On a shared machine (another process takes a core) a worker can be descheduled in the
//! middle of a task, and the caller then waits a whole scheduler time slice for it: a
//! parallel region of 20 us becomes 3 ms, ~150 times per step. The caller times how long it
//! waits for stragglers after finishing its own share; after [`STRIKES`] waits longer than
//! [`STRAGGLER`] in a row it runs the next [`SERIAL_JOBS`] jobs alone (the workers park and
//! leave their core to the other process), then tries the pool again. A job that had to
//! wake a parked worker counts only past [`STRAGGLER_WOKEN`] (a time slice): its wait is
//! mostly the wake-up, not contention (counting it sent the pool serial for thousands of
//! jobs after ordinary idle gaps, e.g. the first regions of every drafter call).

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// Token rows per parallel range of the per-row ops (a row is a few hundred values, well
/// under a microsecond; fewer than twice this many stay on the calling thread).
pub const PAR_ROWS: usize = 8;

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(300);
/// A wait for other threads' tasks this much longer than three of the caller's own tasks
/// means a worker was descheduled (a region's tasks take 1-50 us).
const STRAGGLER: Duration = Duration::from_micros(250);
/// The same for a job that had to wake a parked worker: its wake-up is not contention, a
/// wait of another process's time slice is.
const STRAGGLER_WOKEN: Duration = Duration::from_millis(5);
/// Straggler waits (each decays by one per clean job) that switch the pool to serial.
const STRIKES: u32 = 3;
/// Jobs run on the caller alone after contention was seen (a few decode steps).
const SERIAL_JOBS: u64 = 2048;

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
    busy: Mutex<Contention>,
    size: usize,
}

/// The caller side's view of contention (held under the `busy` lock).
#[derive(Default)]
struct Contention {
    jobs: u64,
    strikes: u32,
    /// Jobs up to this count run serially.
    serial_until: u64,
    /// Times the pool switched to serial (for tests and diagnostics).
    fallbacks: u64,
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
            busy: Mutex::new(Contention::default()),
            size,
        }
    }

    /// Times the pool fell back to serial because workers were descheduled.
    pub fn fallbacks(&self) -> u64 {
        self.busy.lock().map_or(0, |c| c.fallbacks)
    }

    /// Whether the next job runs on the caller alone (a serial period after contention).
    pub fn serial_now(&self) -> bool {
        self.busy.lock().is_ok_and(|c| c.jobs < c.serial_until)
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
        let mut guard = match self.busy.try_lock() {
            Ok(g) if tasks > 1 && self.size > 1 => g,
            _ => {
                (0..tasks).for_each(f);
                return;
            }
        };
        guard.jobs += 1;
        if guard.jobs <= guard.serial_until {
            drop(guard);
            (0..tasks).for_each(f);
            return;
        }
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
        let mut woke = false;
        for (i, sl) in s.sleeping.iter().enumerate() {
            if sl.swap(false, SeqCst) {
                threads[i].unpark();
                woke = true;
            }
        }
        drop(threads);
        let t0 = Instant::now();
        let mine = work(&job);
        let t_own = Instant::now();
        wait_until(|| job.done.load(SeqCst) >= tasks);
        let waited = t_own.elapsed();
        // A worker holds at most one task when the caller runs out of them, so a wait much
        // longer than the caller's own tasks took means the worker was not running.
        let per_task = (t_own - t0) / (mine.max(1) as u32);
        // A worker this job had to wake from park starts late by the wake-up itself (up to a
        // few hundred microseconds on a VM whose idle vCPU halted): that is the first region
        // after an idle gap (a drafter call after the step's sampling), not another process
        // holding the core, unless the wait is as long as that process's time slice.
        let limit = if woke { STRAGGLER_WOKEN } else { STRAGGLER };
        let straggler = waited >= limit + 3 * per_task;
        s.job.store(std::ptr::null_mut(), SeqCst);
        wait_until(|| s.active.load(SeqCst) == 0);
        if straggler {
            guard.strikes += 1;
            if guard.strikes >= STRIKES {
                guard.strikes = 0;
                guard.serial_until = guard.jobs + SERIAL_JOBS;
                guard.fallbacks += 1;
            }
        } else {
            guard.strikes = guard.strikes.saturating_sub(1);
        }
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

/// Runs tasks of `job` until none is left; returns how many this thread ran.
fn work(job: &Job) -> usize {
    let mut ran = 0;
    loop {
        let i = job.next.fetch_add(1, SeqCst);
        if i >= job.tasks {
            return ran;
        }
        ran += 1;
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
            let _ = work(unsafe { &*p });
        }
        s.active.fetch_sub(1, SeqCst);
    }
}

/// A pointer into one buffer that parallel tasks share, each writing its own disjoint part.
pub struct SharedMut<T>(*mut T);
// SAFETY: users promise disjoint writes (see `slice`).
unsafe impl<T> Send for SharedMut<T> {}
// SAFETY: as for `Send`: tasks only touch their own disjoint ranges.
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
        // SAFETY: the caller's contract (the range is inside the live buffer and nobody else
        // touches it while the slice lives).
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// Call first thing in `main`, before any other thread exists. candle's CPU matmul asks
/// `candle_core::utils::get_num_threads()` on every call, and without `RAYON_NUM_THREADS`
/// that reads and parses `/proc/cpuinfo` each time (tens of microseconds: a fifth of a
/// drafter block here, whose confidence head multiplies through candle). This sets
/// `RAYON_NUM_THREADS` to the number candle would have computed, so every later call reads
/// an environment variable instead and the thread counts stay what they were.
pub fn pin_candle_threads() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

/// Call first thing in `main`: a step's freed temporaries stay in the heap for the next.
///
/// glibc serves allocations above its mmap threshold (128 KiB at first) with fresh
/// mappings, and gives the heap's free top back to the kernel past its trim threshold. A
/// step's large temporaries (activations of a 512-token prefill chunk, logits of a wide
/// batch) then come back as new zero pages every step: one page fault per 4 KiB, and in a
/// multi-threaded process each unmap interrupts every core to flush its TLB. Here blocks up
/// to 256 MiB come from the heap and up to 256 MiB of its free top is kept. Measured on 2
/// cores (docs/benchmarks.md): 256- and 512-token prefill steps 10-19 % faster. Setting
/// `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` or `GLIBC_TUNABLES` leaves glibc's
/// choice to the environment.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let set = |v: &str| std::env::var_os(v).is_some();
        if set("MALLOC_MMAP_THRESHOLD_") || set("MALLOC_TRIM_THRESHOLD_") || set("GLIBC_TUNABLES") {
            return;
        }
        // Setting either stops glibc's dynamic threshold, so both are set.
        const KEEP: i32 = 256 << 20;
        // SAFETY: mallopt only changes allocator parameters; called before other threads
        // allocate.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, KEEP);
            libc::mallopt(libc::M_TRIM_THRESHOLD, KEEP);
        }
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

/// Runs `f(r0, r1)` over row ranges covering `0..rows`: on the calling thread alone when
/// there are fewer than `2 * min_rows` rows (a parallel region costs a few microseconds),
/// else cut into about two ranges per thread, each at least `min_rows` long and a multiple
/// of `align` rows (except the last), on the global pool.
///
/// For the per-row ops between the matmuls of a step (norms, RoPE, SiLU, activation
/// quantisation, cache writes): on one thread they grow with the batch while the other
/// threads wait (a fifth of a 64-sequence decode step ran that way).
pub fn for_rows(rows: usize, min_rows: usize, align: usize, f: &(dyn Fn(usize, usize) + Sync)) {
    let threads = global().size();
    if threads <= 1 || rows < 2 * min_rows.max(1) {
        if rows > 0 {
            f(0, rows);
        }
        return;
    }
    let per = rows
        .div_ceil(2 * threads)
        .max(min_rows)
        .next_multiple_of(align.max(1));
    run(rows.div_ceil(per), &|t| {
        f(t * per, ((t + 1) * per).min(rows))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ranges of `for_rows` cover every row once, start on multiples of `align`, and
    /// few rows stay in one range on the calling thread.
    #[test]
    fn row_ranges_cover_every_row_once() {
        for rows in [0usize, 1, 7, 15, 16, 17, 64, 100, 1000] {
            for (min, align) in [(8, 1), (8, 8), (4, 3), (32, 1)] {
                let seen: Vec<AtomicUsize> = (0..rows).map(|_| AtomicUsize::new(0)).collect();
                let ranges = Mutex::new(Vec::new());
                for_rows(rows, min, align, &|r0, r1| {
                    ranges.lock().unwrap().push((r0, r1));
                    for s in &seen[r0..r1] {
                        s.fetch_add(1, SeqCst);
                    }
                });
                assert!(seen.iter().all(|s| s.load(SeqCst) == 1), "{rows} rows");
                let ranges = ranges.into_inner().unwrap();
                assert!(ranges.iter().all(|&(r0, r1)| r0 % align == 0 && r0 < r1));
                if rows < 2 * min {
                    assert!(ranges.len() <= 1, "{rows} rows cut into {ranges:?}");
                }
            }
        }
    }

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

    /// One job of two tasks: the worker's sleeps `late`; the caller's waits until the worker
    /// holds its task, so the caller is left waiting for it.
    fn job_with_a_late_worker(pool: &Pool, late: Duration) {
        let caller = std::thread::current().id();
        let worker_in = AtomicBool::new(false);
        pool.run(2, &|_| {
            if std::thread::current().id() != caller {
                worker_in.store(true, SeqCst);
                std::thread::sleep(late);
            } else {
                let t0 = Instant::now();
                while !worker_in.load(SeqCst) && t0.elapsed() < Duration::from_secs(1) {
                    std::thread::yield_now();
                }
            }
        });
    }

    /// A worker that stalls in its task (as a descheduled one does) makes the pool run
    /// the next jobs on the caller alone; later it uses the workers again.
    #[test]
    fn stalled_workers_switch_the_pool_to_serial() {
        let pool = Pool::new(2);
        let caller = std::thread::current().id();
        // Let the worker start (a job published before it runs is not seen by it).
        std::thread::sleep(Duration::from_millis(25));
        // Longer than a woken worker's allowance too.
        for _ in 0..STRIKES {
            job_with_a_late_worker(&pool, Duration::from_millis(25));
        }
        assert_eq!(pool.fallbacks(), 1);
        assert!(pool.serial_now());
        let on_caller = AtomicUsize::new(0);
        for _ in 0..100 {
            pool.run(8, &|_| {
                if std::thread::current().id() == caller {
                    on_caller.fetch_add(1, SeqCst);
                }
            });
        }
        assert_eq!(on_caller.load(SeqCst), 800, "serial jobs run on the caller");
        // After the serial period the workers take tasks again.
        for _ in 0..SERIAL_JOBS {
            pool.run(2, &|_| {});
        }
        assert!(!pool.serial_now());
        let elsewhere = AtomicUsize::new(0);
        for _ in 0..20 {
            pool.run(16, &|_| {
                if std::thread::current().id() != caller {
                    elsewhere.fetch_add(1, SeqCst);
                }
                std::thread::sleep(Duration::from_micros(100));
            });
        }
        assert!(
            elsewhere.load(SeqCst) > 0,
            "the workers never ran a task again"
        );
    }

    /// A worker woken from park for the job finishes late by its wake-up; jobs after idle
    /// gaps (each waking it), late by less than a time slice, never switch the pool to
    /// serial.
    #[test]
    fn waking_a_parked_worker_is_not_contention() {
        let pool = Pool::new(2);
        for _ in 0..3 * STRIKES {
            // Longer than SPIN: the worker parks.
            std::thread::sleep(Duration::from_millis(5));
            job_with_a_late_worker(&pool, Duration::from_millis(2));
        }
        assert_eq!(pool.fallbacks(), 0);
        assert!(!pool.serial_now());
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
