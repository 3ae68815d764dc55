//! The whole `seam` command line with this backend linked in: `seam-example backends` lists it,
//! `seam-example run --backend example ...` runs it, `seam-example conformance --backend example`
//! holds it to the suite. This file is all a vendor writes to ship its own `seam`.

fn main() -> std::process::ExitCode {
    backend_example::link();
    seam_cli::link_builtin_backends();
    seam_cli::main()
}
