//! The thread-per-core runtime: pinned glommio executors, typed per-core inboxes, accept
//! threads, placement and fatal errors. It names no protocol and no queue: the broker
//! (`broker::node`) and the wiring (`server`) put their own types through it.
//!
//! # Layout
//! - [`spawn_cores`]: one pinned executor thread per core, each running a future the caller
//!   builds for that core.
//! - [`mesh`]: one inbox per core ([`mesh::Inboxes`]) and the batching inbox loop
//!   ([`mesh::drain`]).
//! - [`accept`]: the listening socket of each core (SO_REUSEPORT) and its accept thread.
//! - [`placement`]: which core owns a queue (a pure function of its name).
//! - [`load`]: how busy this core's executor is (lazily measured).
//! - [`fatal`]: errors that end the process.
//!
//! # Assumptions
//! A core never blocks: no std::fs on an executor after start-up; work that must block runs
//! on a dedicated thread behind a channel (glommio's `spawn_blocking` or a plain thread).

pub mod accept;
pub mod failpoint;
pub mod fatal;
pub mod load;
pub mod memory;
pub mod mesh;
pub mod placement;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use glommio::{LocalExecutorBuilder, Placement};

/// Spawns `task` on this core's executor, detached, to start on a later turn of the
/// scheduler, never inside this call.
///
/// glommio 0.9's `spawn_local` polls a new task at once, up to its first pending await
/// (`spawn_and_run`). A task that borrows a `RefCell` its spawner still holds borrowed, before
/// any wait that really waits (a timer already due, a channel with a message in it), then
/// panics with "already borrowed", and `panic = "abort"` ends the broker: seen with a queue's
/// full-sync timer that was due by the time it was polled. Every task the broker spawns
/// starts here instead (all but `server.rs`'s accept loops, spawned holding nothing), so no
/// spawn site has to reason about what its caller holds.
pub fn spawn_soon(task: impl Future<Output = ()> + 'static) {
    glommio::spawn_local(async move {
        futures_lite::future::yield_now().await;
        task.await
    })
    .detach();
}

/// Most inbox messages handled per tick before yielding ([`mesh::drain`]).
pub const BATCH: usize = 1024;

/// Stack of a core thread, bytes (virtual; pages are committed only when touched). A
/// recursive parser on a core (the AMQP field-table parser recurses once per nesting level,
/// and a 128 KiB frame can nest about 26,000 levels) needs far more than a default 2 MiB
/// thread stack; callers refuse what nests deeper than they handle after parsing.
pub const CORE_STACK_BYTES: usize = 256 << 20;

/// How the executors run.
#[derive(Clone, Copy, Debug)]
pub struct Runtime {
    /// Number of executors (cores), at least 1.
    pub cores: u32,
    /// Spin this long (µs) before an idle executor parks in io_uring_enter (0 = never spin).
    pub spin_before_park_us: u64,
}

/// Starts `rt.cores` executor threads named `ringmq-core-{i}`, pinned to CPU `i` when there
/// are at least as many CPUs as cores, and runs `per_core(i)` on executor `i` until that
/// future ends. Returns the threads' handles.
///
/// # Errors
/// When a thread cannot be spawned. An executor that cannot start is fatal ([`fatal::fatal`]).
pub fn spawn_cores<F, Fut>(rt: Runtime, per_core: F) -> std::io::Result<Vec<std::thread::JoinHandle<()>>>
where
    F: Fn(u32) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let cores = rt.cores.max(1);
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let per_core = Arc::new(per_core);
    let mut handles = Vec::new();
    for i in 0..cores {
        let per_core = per_core.clone();
        let placement = if (cores as usize) <= cpus { Placement::Fixed(i as usize) } else { Placement::Unbound };
        let name = format!("ringmq-core-{i}");
        let h = std::thread::Builder::new().name(name.clone()).stack_size(CORE_STACK_BYTES).spawn(move || {
            let mut builder = LocalExecutorBuilder::new(placement).name(&name);
            if rt.spin_before_park_us > 0 {
                builder = builder.spin_before_park(Duration::from_micros(rt.spin_before_park_us));
            }
            let ex = match builder.make() {
                Ok(ex) => ex,
                Err(e) => fatal::fatal(&format!("cannot start executor {name}: {e}")),
            };
            ex.run(per_core(i));
        })?;
        handles.push(h);
    }
    Ok(handles)
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use super::spawn_soon;

    /// A task with nothing to wait for, spawned while its spawner borrows what it borrows:
    /// glommio's own `spawn_local` would run it inside the call and panic on that borrow.
    #[test]
    fn a_task_spawned_soon_starts_after_its_spawner_lets_go() {
        let ex = glommio::LocalExecutorBuilder::default().make().expect("an executor");
        ex.run(async {
            let cell = Rc::new(RefCell::new(0u32));
            let held = cell.borrow_mut();
            let c = cell.clone();
            spawn_soon(async move { *c.borrow_mut() += 1 });
            drop(held);
            assert_eq!(*cell.borrow(), 0, "the task ran inside the call");
            for _ in 0..100 {
                if *cell.borrow() == 1 {
                    break;
                }
                futures_lite::future::yield_now().await;
            }
            assert_eq!(*cell.borrow(), 1, "the task never ran");
        });
    }
}
