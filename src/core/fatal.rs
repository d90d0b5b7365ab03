//! Fatal errors end the process: a panic or a failed fsync on one core must not leave the
//! others half-alive (DESIGN.md, "Errors and bad input"). The store is crash-safe, so a
//! restart recovers everything confirmed.

/// Logs `what` and exits the whole process with status 70 (EX_SOFTWARE).
pub fn fatal(what: &str) -> ! {
    tracing::error!("fatal: {what}");
    crate::observe::log::stderr_line(&format!("ringmq: fatal: {what}"));
    std::process::exit(70)
}

/// Makes a panic on any thread fatal to the process (the dev profile unwinds; the release
/// profile already aborts).
pub fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        crate::observe::log::stderr_line("ringmq: fatal: panic, exiting");
        std::process::abort();
    }));
}
