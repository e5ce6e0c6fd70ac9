//! Where the machine's CPU went during a phase of a benchmark (Linux): how busy the cores were
//! (`/proc/stat`) and the shares of PostgreSQL, of the fleet's processes, of the bench's own
//! process and of RabbitMQ (each process's own counters under `/proc/<pid>`). A figure is worth
//! little without knowing whether the machine had room left: a phase that kept the cores busy
//! is bounded by CPU, and the shares say whose.
//!
//! A process's time is the larger of the two counts the kernel keeps for it: the scheduler's
//! runtime of its live threads (`/proc/<pid>/task/<tid>/schedstat`, in nanoseconds, without
//! the threads that have ended) and its user and system time (`/proc/<pid>/stat`, in ticks,
//! with them). The second alone fell short for young processes: over a drain, the backends the
//! workers had just opened showed half the time their scheduler's runtime did (and `perf`
//! agreed with the runtime), so PostgreSQL read 47 % of the machine and "the rest" 24 % when
//! PostgreSQL's processes had taken some 70 %.
//!
//! A process that ends during the phase is still counted: its time goes to its parent's
//! children's time when the parent reaps it (PostgreSQL's backends to the postmaster, the
//! fleet's stopped processes and pgbench to the bench), and parents are counted with it.

use std::fmt;

/// Nanoseconds of CPU used so far, machine-wide and by each group of processes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sample {
    /// Every core's ticks, whatever they did.
    total: u64,
    /// Idle or waiting for I/O.
    idle: u64,
    /// Taken by the hypervisor for other machines.
    steal: u64,
    groups: Groups,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Groups {
    postgres: u64,
    /// Other processes of this binary (the fleet's `serve` and `work`), and this one's children.
    fleet: u64,
    /// This process: the bench's clients and watchers (and, run in process, the fleet).
    bench: u64,
    rabbitmq: u64,
}

/// The machine's CPU over an interval, each a share of all its cores (0 to 1), and the
/// interval's time on all of them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    /// Every core's time over the interval, in seconds: the shares' whole.
    pub core_seconds: f64,
    pub busy: f64,
    pub steal: f64,
    pub postgres: f64,
    pub fleet: f64,
    pub bench: f64,
    pub rabbitmq: f64,
}

/// The CPU used between two samples, when both could be taken.
pub fn between(before: Option<Sample>, after: Option<Sample>) -> Option<Usage> {
    before.zip(after).map(|(b, a)| a.since(&b))
}

/// Nanoseconds in a tick of `/proc/stat` and `/proc/<pid>/stat`: `USER_HZ`, which Linux fixes
/// at 100 for what it shows user space, whatever the kernel's own tick.
const TICK_NS: u64 = 10_000_000;

/// Reads the counters now; none where `/proc` cannot be read (not Linux).
pub fn sample() -> Option<Sample> {
    let (total, idle, steal) = machine(&std::fs::read_to_string("/proc/stat").ok()?)?;
    let me = std::process::id();
    // The fleet's processes run this binary, whatever it is called (a copy kept to compare two
    // builds, say): its name as the kernel keeps it.
    let this_binary = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|text| process(&text).map(|p| p.comm.to_owned()));
    let mut groups = Groups::default();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        // A process may end between the listing and the read.
        let Ok(text) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some(mut p) = process(&text) else {
            continue;
        };
        p.own = p.own.max(runtime(&entry.path()));
        match p.comm {
            "postgres" => groups.postgres += p.own + p.children,
            // The broker's runtime and its port helper (which runs its disk checks).
            "beam.smp" | "erl_child_setup" => groups.rabbitmq += p.own + p.children,
            _ if pid == me => {
                groups.bench += p.own;
                groups.fleet += p.children;
            }
            name if name == "payfleet" || Some(name) == this_binary.as_deref() => {
                groups.fleet += p.own + p.children
            }
            _ => {}
        }
    }
    Some(Sample {
        total,
        idle,
        steal,
        groups,
    })
}

impl Sample {
    /// The CPU used between `earlier` and this sample.
    pub fn since(&self, earlier: &Sample) -> Usage {
        let total = self.total.saturating_sub(earlier.total).max(1) as f64;
        let share = |now: u64, then: u64| now.saturating_sub(then) as f64 / total;
        let idle = share(self.idle, earlier.idle);
        let steal = share(self.steal, earlier.steal);
        Usage {
            core_seconds: total / 1e9,
            busy: (1.0 - idle - steal).max(0.0),
            steal,
            postgres: share(self.groups.postgres, earlier.groups.postgres),
            fleet: share(self.groups.fleet, earlier.groups.fleet),
            bench: share(self.groups.bench, earlier.groups.bench),
            rabbitmq: share(self.groups.rabbitmq, earlier.groups.rabbitmq),
        }
    }
}

impl Usage {
    /// Busy, but not in any of the groups: the kernel's own threads and interrupts (the
    /// loopback network's, the disk's), other processes.
    pub fn rest(&self) -> f64 {
        (self.busy - self.postgres - self.fleet - self.bench - self.rabbitmq).max(0.0)
    }

    /// The CPU the interval's `count` pieces of work (checkouts, payments) cost each, in
    /// milliseconds of one core: what a rate can be bought for on a machine of any size, where
    /// the busy share says only whether this one had room left.
    pub fn each(&self, count: usize) -> Each {
        let ms = |share: f64| share * self.core_seconds * 1e3 / count.max(1) as f64;
        Each {
            busy: ms(self.busy),
            postgres: ms(self.postgres),
            fleet: ms(self.fleet),
            bench: ms(self.bench),
            rabbitmq: ms(self.rabbitmq),
        }
    }
}

/// [`Usage::each`]: milliseconds of CPU a piece, in all and by group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Each {
    pub busy: f64,
    pub postgres: f64,
    pub fleet: f64,
    pub bench: f64,
    pub rabbitmq: f64,
}

impl fmt::Display for Each {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.2} ms of CPU each: PostgreSQL {:.2} ms, the fleet's processes {:.2} ms, the \
             bench's process {:.2} ms, RabbitMQ {:.2} ms",
            self.busy, self.postgres, self.fleet, self.bench, self.rabbitmq
        )
    }
}

impl fmt::Display for Usage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pc = |x: f64| (x * 100.0).round();
        write!(f, "the cores {:.0} % busy", pc(self.busy))?;
        if self.steal >= 0.005 {
            write!(f, " ({:.0} % stolen by the hypervisor)", pc(self.steal))?;
        }
        write!(
            f,
            ": PostgreSQL {:.0} %, the fleet's processes {:.0} %, the bench's process {:.0} %, \
             RabbitMQ {:.0} %, the rest {:.0} %",
            pc(self.postgres),
            pc(self.fleet),
            pc(self.bench),
            pc(self.rabbitmq),
            pc(self.rest())
        )
    }
}

/// All cores' time, that idle (or waiting for I/O) and that stolen, from `/proc/stat`, in
/// nanoseconds.
fn machine(stat: &str) -> Option<(u64, u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    // user nice system idle iowait irq softirq steal (guest time is inside user already).
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let [_, _, _, idle, iowait, _, _, steal] = ticks.as_slice() else {
        return None;
    };
    Some((
        ticks.iter().sum::<u64>() * TICK_NS,
        (idle + iowait) * TICK_NS,
        steal * TICK_NS,
    ))
}

/// A process's name and ticks, from its `/proc/<pid>/stat`.
struct Process<'a> {
    comm: &'a str,
    /// Its own user and system time, in nanoseconds.
    own: u64,
    /// Its reaped children's, in nanoseconds.
    children: u64,
}

fn process(stat: &str) -> Option<Process<'_>> {
    // The name is in parentheses and may hold spaces or parentheses of its own.
    let (head, rest) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state (0), ..., utime (11), stime (12), cutime (13), cstime (14).
    let tick = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    Some(Process {
        comm,
        own: (tick(11)? + tick(12)?) * TICK_NS,
        children: (tick(13)? + tick(14)?) * TICK_NS,
    })
}

/// The scheduler's runtime of the live threads of the process at `dir` (`/proc/<pid>`), in
/// nanoseconds: 0 where the kernel keeps no such count.
fn runtime(dir: &std::path::Path) -> u64 {
    let Ok(tasks) = std::fs::read_dir(dir.join("task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|text| on_cpu(&text))
        .sum()
}

/// A thread's time on a CPU, the first of the three numbers of its `schedstat`.
fn on_cpu(schedstat: &str) -> Option<u64> {
    schedstat.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `actual` is `expected`, but for the floating point's rounding.
    #[track_caller]
    fn assert_close(actual: f64, expected: f64) {
        assert!(
            (actual - expected).abs() < 1e-9,
            "{actual} is not {expected}"
        );
    }

    #[test]
    fn the_machines_ticks_are_read_from_proc_stat() {
        let stat = "cpu  100 5 50 800 20 3 2 10 0 0\ncpu0 50 2 25 400 10 1 1 5 0 0\nintr 1\n";
        assert_eq!(
            machine(stat),
            Some((990 * TICK_NS, 820 * TICK_NS, 10 * TICK_NS))
        );
        assert_eq!(machine("intr 1\n"), None);
        assert_eq!(machine("cpu  1 2 x 4 5 6 7 8\n"), None);
    }

    #[test]
    fn a_processs_name_and_ticks_are_read_even_with_parentheses_in_its_name() {
        let stat = "4242 (postgres: wal (writer)) S 1 4242 4242 0 -1 4194368 1 0 0 0 \
                    17 4 30 6 20 0 1 0 100 0 0";
        let p = process(stat).unwrap();
        assert_eq!(p.comm, "postgres: wal (writer)");
        assert_eq!((p.own, p.children), (21 * TICK_NS, 36 * TICK_NS));
        assert!(process("4242 (postgres) S 1").is_none());
    }

    #[test]
    fn usage_is_each_groups_share_of_every_core() {
        let earlier = Sample {
            total: 1000,
            idle: 400,
            steal: 0,
            groups: Groups {
                postgres: 100,
                fleet: 0,
                bench: 50,
                rabbitmq: 10,
            },
        };
        let now = Sample {
            total: 1200,
            idle: 420,
            steal: 20,
            groups: Groups {
                postgres: 200,
                fleet: 30,
                bench: 70,
                rabbitmq: 20,
            },
        };
        let u = now.since(&earlier);
        assert_close(u.busy, 0.8);
        assert_close(u.steal, 0.1);
        assert_close(u.postgres, 0.5);
        assert_close(u.fleet, 0.15);
        assert_close(u.bench, 0.1);
        assert_close(u.rabbitmq, 0.05);
        assert_eq!(
            u.to_string(),
            "the cores 80 % busy (10 % stolen by the hypervisor): PostgreSQL 50 %, the fleet's \
             processes 15 %, the bench's process 10 %, RabbitMQ 5 %, the rest 0 %"
        );
    }

    #[test]
    fn each_piece_costs_its_share_of_the_busy_core_time() {
        // Two cores for two seconds, 80 % busy: 3.2 core-seconds over 1,600 payments.
        let u = Usage {
            core_seconds: 4.0,
            busy: 0.8,
            steal: 0.0,
            postgres: 0.5,
            fleet: 0.15,
            bench: 0.1,
            rabbitmq: 0.05,
        };
        let each = u.each(1_600);
        assert_close(each.busy, 2.0);
        assert_close(each.postgres, 1.25);
        assert_close(each.fleet, 0.375);
        assert_close(each.bench, 0.25);
        assert_close(each.rabbitmq, 0.125);
        assert_eq!(
            each.to_string(),
            "2.00 ms of CPU each: PostgreSQL 1.25 ms, the fleet's processes 0.38 ms, the bench's \
             process 0.25 ms, RabbitMQ 0.12 ms"
        );
        // Nothing counted is no division by zero.
        assert!(u.each(0).busy.is_finite());
    }

    #[test]
    fn a_threads_time_on_a_cpu_is_the_first_number_of_its_schedstat() {
        assert_eq!(on_cpu("123456789 2000 30\n"), Some(123_456_789));
        assert_eq!(on_cpu(""), None);
        assert_eq!(on_cpu("x 1 2"), None);
    }

    #[test]
    fn the_runtime_of_every_live_thread_of_a_process_is_summed() {
        let me = std::path::Path::new("/proc/self");
        if !me.join("task").exists() {
            return; // not Linux
        }
        let before = runtime(me);
        // Work on a thread of its own: counted only if every thread's count is read.
        let worker = std::thread::spawn(|| {
            let started = std::time::Instant::now();
            let mut x = 0u64;
            while started.elapsed() < std::time::Duration::from_millis(200) {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
            // Read while the thread is alive: a thread that has ended leaves the count.
            runtime(std::path::Path::new("/proc/self"))
        });
        let during = worker.join().unwrap();
        if !me
            .join("task")
            .join(format!("{}", std::process::id()))
            .join("schedstat")
            .exists()
        {
            return; // a kernel that keeps no scheduler statistics
        }
        assert!(
            during >= before + 150_000_000,
            "{} ms counted for 200 ms of work",
            during.saturating_sub(before) / 1_000_000
        );
    }

    #[test]
    fn this_processs_own_work_is_counted_as_the_benchs() {
        let Some(before) = sample() else {
            return; // not Linux
        };
        let started = std::time::Instant::now();
        let mut x = 0u64;
        while started.elapsed() < std::time::Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let after = sample().unwrap();
        let u = after.since(&before);
        assert!(u.bench > 0.0, "{u}");
        assert!(u.busy >= u.bench * 0.9, "{u}");
    }
}
