//! `seam`: the command line with seam's own backends linked in.

fn main() -> std::process::ExitCode {
    seam_cli::link_builtin_backends();
    seam_cli::main()
}
