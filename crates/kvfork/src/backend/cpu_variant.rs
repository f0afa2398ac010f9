//! Which of ggml's CPU backend variants to load (builds with `dynamic-backends`).
//!
//! ggml built with `GGML_CPU_ALL_VARIANTS` has one CPU backend module per x86 instruction-set
//! level (`libggml-cpu-haswell.so`, `libggml-cpu-zen4.so`, ...). ggml's own loader takes the
//! highest-scoring module, which on a CPU with AMX is `sapphirerapids`, whose AMX kernels
//! crashed here on the first decode (DESIGN.md). kvfork chooses itself: the most capable
//! variant whose instruction sets this CPU has (with the OS support `is_x86_feature_detected!`
//! checks and ggml's score does not), never one with AMX.

/// An instruction set a CPU variant is compiled for (ggml's `GGML_*` CMake names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// SSE 4.2.
    Sse42,
    /// AVX.
    Avx,
    /// Half-precision conversions.
    F16c,
    /// Fused multiply-add.
    Fma,
    /// AVX2.
    Avx2,
    /// BMI2.
    Bmi2,
    /// AVX-VNNI (VEX-encoded dot products).
    AvxVnni,
    /// ggml's `AVX512`: AVX-512 F, CD, VL, DQ and BW together.
    Avx512,
    /// AVX-512 VBMI.
    Avx512Vbmi,
    /// AVX-512 VNNI.
    Avx512Vnni,
    /// AVX-512 BF16.
    Avx512Bf16,
    /// AMX tiles with int8: never loaded (crashes on VMs).
    AmxInt8,
}

impl Isa {
    /// ggml's name of the instruction set (as in `ggml_backend_get_features`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Sse42 => "SSE42",
            Isa::Avx => "AVX",
            Isa::F16c => "F16C",
            Isa::Fma => "FMA",
            Isa::Avx2 => "AVX2",
            Isa::Bmi2 => "BMI2",
            Isa::AvxVnni => "AVX_VNNI",
            Isa::Avx512 => "AVX512",
            Isa::Avx512Vbmi => "AVX512_VBMI",
            Isa::Avx512Vnni => "AVX512_VNNI",
            Isa::Avx512Bf16 => "AVX512_BF16",
            Isa::AmxInt8 => "AMX_INT8",
        }
    }

    /// ggml's weight of the instruction set in a variant's score
    /// (`ggml-cpu/arch/x86/cpu-feats.cpp`), so that kvfork ranks variants as ggml does.
    fn weight(self) -> u32 {
        match self {
            Isa::Fma => 1,
            Isa::F16c => 1 << 1,
            Isa::Sse42 => 1 << 2,
            Isa::Bmi2 => 1 << 3,
            Isa::Avx => 1 << 4,
            Isa::Avx2 => 1 << 5,
            Isa::AvxVnni => 1 << 6,
            Isa::Avx512 => 1 << 7,
            Isa::Avx512Vbmi => 1 << 8,
            Isa::Avx512Bf16 => 1 << 9,
            Isa::Avx512Vnni => 1 << 10,
            Isa::AmxInt8 => 1 << 11,
        }
    }

    /// Whether this CPU (and its OS, for the wide registers) supports the instruction set.
    pub fn on_host(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Isa::Sse42 => has!("sse4.2"),
                Isa::Avx => has!("avx"),
                Isa::F16c => has!("f16c"),
                Isa::Fma => has!("fma"),
                Isa::Avx2 => has!("avx2"),
                Isa::Bmi2 => has!("bmi2"),
                Isa::AvxVnni => has!("avxvnni"),
                Isa::Avx512 => {
                    has!("avx512f")
                        && has!("avx512cd")
                        && has!("avx512vl")
                        && has!("avx512dq")
                        && has!("avx512bw")
                }
                Isa::Avx512Vbmi => has!("avx512vbmi"),
                Isa::Avx512Vnni => has!("avx512vnni"),
                Isa::Avx512Bf16 => has!("avx512bf16"),
                // Never reported: the AMX variant is refused whatever the CPU has.
                Isa::AmxInt8 => false,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
}

/// One CPU backend module of ggml: `libggml-cpu-<name>.so`, compiled for `isas`.
#[derive(Debug, PartialEq, Eq)]
pub struct CpuVariant {
    /// ggml's tag of the variant (the module's file name between `libggml-cpu-` and `.so`).
    pub name: &'static str,
    /// The instruction sets it is compiled for (beyond x86-64's SSE2).
    pub isas: &'static [Isa],
}

use Isa::*;

/// ggml's x86 variants (`ggml/src/CMakeLists.txt`, `GGML_CPU_ALL_VARIANTS`).
pub const X86_VARIANTS: &[CpuVariant] = &[
    CpuVariant {
        name: "x64",
        isas: &[],
    },
    CpuVariant {
        name: "sse42",
        isas: &[Sse42],
    },
    CpuVariant {
        name: "sandybridge",
        isas: &[Sse42, Avx],
    },
    CpuVariant {
        name: "ivybridge",
        isas: &[Sse42, Avx, F16c],
    },
    CpuVariant {
        name: "piledriver",
        isas: &[Sse42, Avx, F16c, Fma],
    },
    CpuVariant {
        name: "haswell",
        isas: &[Sse42, Avx, F16c, Fma, Avx2, Bmi2],
    },
    CpuVariant {
        name: "skylakex",
        isas: &[Sse42, Avx, F16c, Fma, Avx2, Bmi2, Avx512],
    },
    CpuVariant {
        name: "cannonlake",
        isas: &[Sse42, Avx, F16c, Fma, Avx2, Bmi2, Avx512, Avx512Vbmi],
    },
    CpuVariant {
        name: "cascadelake",
        isas: &[Sse42, Avx, F16c, Fma, Avx2, Bmi2, Avx512, Avx512Vnni],
    },
    CpuVariant {
        name: "icelake",
        isas: &[
            Sse42, Avx, F16c, Fma, Avx2, Bmi2, Avx512, Avx512Vbmi, Avx512Vnni,
        ],
    },
    CpuVariant {
        name: "cooperlake",
        isas: &[
            Sse42, Avx, F16c, Fma, Avx2, Bmi2, Avx512, Avx512Vnni, Avx512Bf16,
        ],
    },
    CpuVariant {
        name: "zen4",
        isas: &[
            Sse42, Avx, F16c, Fma, Avx2, Bmi2, Avx512, Avx512Vbmi, Avx512Vnni, Avx512Bf16,
        ],
    },
    CpuVariant {
        name: "alderlake",
        isas: &[Sse42, Avx, F16c, Fma, Avx2, Bmi2, AvxVnni],
    },
    CpuVariant {
        name: "sapphirerapids",
        isas: &[
            Sse42, Avx, F16c, Fma, Avx2, Bmi2, Avx512, Avx512Vbmi, Avx512Vnni, Avx512Bf16, AmxInt8,
        ],
    },
];

impl CpuVariant {
    /// ggml's score of the variant on a CPU that has all its instruction sets.
    fn score(&self) -> u32 {
        1 + self.isas.iter().map(|isa| isa.weight()).sum::<u32>()
    }

    /// The first of its instruction sets `host` lacks (`None`: it runs there).
    fn first_missing(&self, host: &dyn Fn(Isa) -> bool) -> Option<Isa> {
        self.isas.iter().copied().find(|&isa| !host(isa))
    }

    /// Whether it contains AMX code (never loaded: ggml's AMX kernels crash on VMs).
    pub fn has_amx(&self) -> bool {
        self.isas.contains(&AmxInt8)
    }
}

/// The variant to load and why.
#[derive(Debug, PartialEq, Eq)]
pub struct Choice {
    /// The variant.
    pub variant: &'static CpuVariant,
    /// One sentence: why this one (for `system_info()`).
    pub reason: String,
}

/// Chooses among the `available` variants (the modules present): `forced` by name
/// (`KVFORK_CPU_VARIANT`) if it runs on `host`, else the highest-scoring one that runs there.
/// AMX variants are never chosen. Errs with a sentence when none fits.
pub fn choose(
    available: &[&str],
    host: &dyn Fn(Isa) -> bool,
    forced: Option<&str>,
) -> Result<Choice, String> {
    let present = |v: &&CpuVariant| available.contains(&v.name);
    if let Some(name) = forced {
        let Some(v) = X86_VARIANTS.iter().find(|v| v.name == name) else {
            let names: Vec<_> = X86_VARIANTS
                .iter()
                .filter(present)
                .map(|v| v.name)
                .collect();
            return Err(format!(
                "KVFORK_CPU_VARIANT={name:?} names no CPU variant (this build has: {})",
                names.join(", ")
            ));
        };
        if v.has_amx() {
            return Err(format!(
                "KVFORK_CPU_VARIANT={name:?} is refused: ggml's AMX kernels crash on VMs"
            ));
        }
        if !present(&v) {
            return Err(format!(
                "KVFORK_CPU_VARIANT={name:?}: this build ships no module for it"
            ));
        }
        if let Some(isa) = v.first_missing(host) {
            return Err(format!(
                "KVFORK_CPU_VARIANT={name:?} needs {} which this CPU lacks",
                isa.name()
            ));
        }
        return Ok(Choice {
            variant: v,
            reason: format!("KVFORK_CPU_VARIANT={name} (this CPU has its instruction sets)"),
        });
    }
    let best = X86_VARIANTS
        .iter()
        .filter(present)
        .filter(|v| !v.has_amx() && v.first_missing(host).is_none())
        .max_by_key(|v| v.score());
    let Some(best) = best else {
        return Err(format!(
            "no CPU variant of llama.cpp runs on this CPU (modules found: {})",
            if available.is_empty() {
                "none".to_string()
            } else {
                available.join(", ")
            }
        ));
    };
    let isas: Vec<_> = best.isas.iter().map(|i| i.name()).collect();
    let mut reason = if isas.is_empty() {
        "baseline x86-64 (SSE2): this CPU has none of the other variants' instruction sets"
            .to_string()
    } else {
        format!(
            "the most capable variant whose instruction sets this CPU has ({})",
            isas.join(" ")
        )
    };
    // Say what was passed over for AMX, so a user of an AMX machine knows why.
    if X86_VARIANTS
        .iter()
        .any(|v| v.has_amx() && v.score() > best.score() && present(&v))
    {
        reason.push_str("; the AMX variant is never loaded (it crashes on VMs)");
    }
    Ok(Choice {
        variant: best,
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_names() -> Vec<&'static str> {
        X86_VARIANTS.iter().map(|v| v.name).collect()
    }

    fn host_with(isas: &'static [Isa]) -> impl Fn(Isa) -> bool {
        move |isa| isas.contains(&isa)
    }

    #[test]
    fn an_old_cpu_gets_the_baseline() {
        let c = choose(&all_names(), &host_with(&[]), None).unwrap();
        assert_eq!(c.variant.name, "x64");
        let c = choose(&all_names(), &host_with(&[Sse42]), None).unwrap();
        assert_eq!(c.variant.name, "sse42");
    }

    #[test]
    fn haswell_without_avx512() {
        let host = host_with(&[Sse42, Avx, F16c, Fma, Avx2, Bmi2]);
        assert_eq!(
            choose(&all_names(), &host, None).unwrap().variant.name,
            "haswell"
        );
        // AVX-VNNI ranks above AVX2 alone (Alder Lake and later).
        let host = host_with(&[Sse42, Avx, F16c, Fma, Avx2, Bmi2, AvxVnni]);
        assert_eq!(
            choose(&all_names(), &host, None).unwrap().variant.name,
            "alderlake"
        );
    }

    #[test]
    fn amx_is_never_chosen() {
        // A Sapphire Rapids host that reports AMX: zen4 (same ISAs but AMX) wins.
        let host = |_: Isa| true;
        let c = choose(&all_names(), &host, None).unwrap();
        assert_eq!(c.variant.name, "zen4");
        assert!(c.reason.contains("AMX"), "{}", c.reason);
        let err = choose(&all_names(), &host, Some("sapphirerapids")).unwrap_err();
        assert!(err.contains("refused"), "{err}");
    }

    #[test]
    fn only_present_modules_count() {
        let host = |_: Isa| true;
        let c = choose(&["x64", "haswell"], &host, None).unwrap();
        assert_eq!(c.variant.name, "haswell");
        let err = choose(&[], &host, None).unwrap_err();
        assert!(err.contains("no CPU variant"), "{err}");
        let err = choose(&["haswell"], &host_with(&[Sse42]), None).unwrap_err();
        assert!(err.contains("haswell"), "{err}");
    }

    #[test]
    fn forced_variant_must_run_here() {
        let host = host_with(&[Sse42, Avx, F16c, Fma, Avx2, Bmi2]);
        let c = choose(&all_names(), &host, Some("sse42")).unwrap();
        assert_eq!(c.variant.name, "sse42");
        let err = choose(&all_names(), &host, Some("skylakex")).unwrap_err();
        assert!(err.contains("AVX512"), "{err}");
        let err = choose(&all_names(), &host, Some("pentium")).unwrap_err();
        assert!(err.contains("names no CPU variant"), "{err}");
        let err = choose(&["x64"], &host, Some("haswell")).unwrap_err();
        assert!(err.contains("no module"), "{err}");
    }

    #[test]
    fn this_host_gets_a_variant() {
        // Whatever this machine is, some variant with no AMX runs on it.
        let c = choose(&all_names(), &|isa: Isa| isa.on_host(), None).unwrap();
        assert!(!c.variant.has_amx());
        assert!(c.variant.isas.iter().all(|i| i.on_host()));
    }
}
