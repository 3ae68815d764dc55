//! Compiled executables: execution with donation, serialization.

use crate::buffer::Buffer;
use crate::client::Client;
use crate::error::PjrtError;
use crate::{args, call, sys, Result};
use std::sync::Arc;

/// An argument of [`LoadedExecutable::execute`].
pub enum ExecuteArg<'a> {
    /// Read by the execution and left intact (weights): never donated, even where the program
    /// aliases it to an output.
    Keep(&'a Buffer),
    /// Handed to the execution, which may reuse its memory for an aliased output (a KV cache
    /// updated in place). Consumed whether or not the plugin reused it.
    Donate(Buffer),
}

/// A program compiled for, and loaded on, a client's device.
pub struct LoadedExecutable {
    client: Arc<Client>,
    raw: *mut sys::PJRT_LoadedExecutable,
    num_outputs: usize,
}

// SAFETY: PJRT executables may be executed concurrently from any thread.
unsafe impl Send for LoadedExecutable {}
unsafe impl Sync for LoadedExecutable {}

/// A `PJRT_Executable` view of a loaded executable, freed on drop.
struct ExecutableView<'a> {
    client: &'a Client,
    raw: *mut sys::PJRT_Executable,
}

impl Drop for ExecutableView<'_> {
    fn drop(&mut self) {
        let mut a = args!(PJRT_Executable_Destroy_Args { executable: self.raw });
        let _ = call!(self.client.plugin(), PJRT_Executable_Destroy, &mut a);
    }
}

impl LoadedExecutable {
    pub(crate) fn new(client: Arc<Client>, raw: *mut sys::PJRT_LoadedExecutable) -> Result<LoadedExecutable> {
        let mut executable = LoadedExecutable { client, raw, num_outputs: 0 };
        let view = executable.view()?;
        let mut a = args!(PJRT_Executable_NumOutputs_Args { executable: view.raw });
        call!(executable.client.plugin(), PJRT_Executable_NumOutputs, &mut a)?;
        drop(view);
        executable.num_outputs = a.num_outputs;
        Ok(executable)
    }

    fn view(&self) -> Result<ExecutableView<'_>> {
        let mut a = args!(PJRT_LoadedExecutable_GetExecutable_Args { loaded_executable: self.raw });
        call!(self.client.plugin(), PJRT_LoadedExecutable_GetExecutable, &mut a)?;
        Ok(ExecutableView { client: &self.client, raw: a.executable })
    }

    /// Results per execution.
    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }

    /// Runs the program on the client's device and waits for it. Returns its outputs, resident
    /// on the device.
    pub fn execute(&self, args: Vec<ExecuteArg<'_>>) -> Result<Vec<Buffer>> {
        self.launch(args)?.finish()
    }

    /// Starts the program on the client's device and returns at once: its outputs (each ready
    /// when the program is done; a copy to the host waits for that) and the execution to
    /// [`Launched::finish`]. On a GPU, reading a small output back right after the launch saves
    /// the host a wake-up per call over waiting first and copying after.
    pub fn launch(&self, args: Vec<ExecuteArg<'_>>) -> Result<Launched> {
        let raw_args: Vec<*mut sys::PJRT_Buffer> = args
            .iter()
            .map(|a| match a {
                ExecuteArg::Keep(b) => b.raw,
                ExecuteArg::Donate(b) => b.raw,
            })
            .collect();
        let keep: Vec<i64> =
            args.iter().enumerate().filter(|(_, a)| matches!(a, ExecuteArg::Keep(_))).map(|(i, _)| i as i64).collect();
        let mut options = args!(PJRT_ExecuteOptions {
            non_donatable_input_indices: keep.as_ptr(),
            num_non_donatable_input_indices: keep.len(),
        });
        let argument_lists: [*const *mut sys::PJRT_Buffer; 1] = [raw_args.as_ptr()];
        let mut outputs: Vec<*mut sys::PJRT_Buffer> = vec![std::ptr::null_mut(); self.num_outputs];
        let output_lists: [*mut *mut sys::PJRT_Buffer; 1] = [outputs.as_mut_ptr()];
        let mut complete: [*mut sys::PJRT_Event; 1] = [std::ptr::null_mut()];
        let mut a = args!(PJRT_LoadedExecutable_Execute_Args {
            executable: self.raw,
            options: &mut options,
            argument_lists: argument_lists.as_ptr(),
            num_devices: 1,
            num_args: raw_args.len(),
            output_lists: output_lists.as_ptr(),
            device_complete_events: complete.as_mut_ptr(),
        });
        let launched = call!(self.client.plugin(), PJRT_LoadedExecutable_Execute, &mut a);
        // Donated buffers are the plugin's now (or deleted); their handles are freed here either way.
        drop(args);
        launched?;
        let outputs: Result<Vec<Buffer>> = outputs
            .into_iter()
            .map(|raw| {
                if raw.is_null() {
                    Err(PjrtError::InvalidArgument("the execution returned a missing output".into()))
                } else {
                    Ok(Buffer { client: Arc::clone(&self.client), raw, lent: None })
                }
            })
            .collect::<Result<_>>();
        // Made before the outputs are checked: an error still waits for the execution.
        let completion = Completion { client: Arc::clone(&self.client), complete: complete[0] };
        Ok(Launched { completion, outputs: outputs? })
    }

    /// The executable's serialized form, for [`Client::deserialize`] (an on-disk cache).
    pub fn serialize(&self) -> Result<Vec<u8>> {
        let view = self.view()?;
        let mut a = args!(PJRT_Executable_Serialize_Args { executable: view.raw });
        call!(self.client.plugin(), PJRT_Executable_Serialize, &mut a)?;
        let bytes = if a.serialized_bytes.is_null() {
            Vec::new()
        } else {
            // SAFETY: the plugin returned `serialized_bytes_size` bytes, alive until the deleter runs.
            unsafe { std::slice::from_raw_parts(a.serialized_bytes as *const u8, a.serialized_bytes_size) }.to_vec()
        };
        if let Some(deleter) = a.serialized_executable_deleter {
            // SAFETY: called once, on the object the plugin returned with it.
            unsafe { deleter(a.serialized_executable) };
        }
        if bytes.is_empty() {
            return Err(PjrtError::InvalidArgument("the plugin serialized the executable to no bytes".into()));
        }
        Ok(bytes)
    }
}

/// A program started by [`LoadedExecutable::launch`]: its outputs and its completion.
pub struct Launched {
    completion: Completion,
    outputs: Vec<Buffer>,
}

/// The completion of a launched program: [`Completion::wait`] for it; dropped unfired, it is
/// waited for (its event is freed only after it fired).
pub struct Completion {
    client: Arc<Client>,
    complete: *mut sys::PJRT_Event,
}

// SAFETY: a PJRT event may be awaited and destroyed from any thread, once.
unsafe impl Send for Completion {}

impl Completion {
    /// Waits for the program to finish; its error, if it failed.
    pub fn wait(mut self) -> Result<()> {
        let complete = std::mem::replace(&mut self.complete, std::ptr::null_mut());
        self.client.plugin().await_event(complete)
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        let _ = self.client.plugin().await_event(std::mem::replace(&mut self.complete, std::ptr::null_mut()));
    }
}

impl Launched {
    /// The outputs, resident on the device (ready once the program is done).
    pub fn outputs(&self) -> &[Buffer] {
        &self.outputs
    }

    /// Waits for the program to finish and returns its outputs, or its error.
    pub fn finish(self) -> Result<Vec<Buffer>> {
        let (outputs, completion) = self.into_parts();
        completion.wait()?;
        Ok(outputs)
    }

    /// The outputs, and the completion apart from them, without waiting: an output may be passed
    /// (donated, even) to the next launch before this program is done, the device orders the
    /// two, so a host can queue a step while the one before it runs.
    pub fn into_parts(self) -> (Vec<Buffer>, Completion) {
        (self.outputs, self.completion)
    }
}

impl Drop for LoadedExecutable {
    fn drop(&mut self) {
        let mut a = args!(PJRT_LoadedExecutable_Destroy_Args { executable: self.raw });
        let _ = call!(self.client.plugin(), PJRT_LoadedExecutable_Destroy, &mut a);
    }
}
