/* Put ahead of GCC's own headers by `make llama` (-isystem): GCC's <immintrin.h> includes this file in place of its
 * own <amxtileintrin.h>, which it then includes below.
 *
 * Why: GCC 12's _tile_loadconfig hands `ldtilecfg` its 64-byte tile configuration through an asm memory operand
 * declared as 8 bytes (`"m" (*((const void **)__config))`). The compiler may then treat the stores that fill the
 * rest of the configuration (rows and column widths) as dead and drop them: in ggml's AMX matmul (a configuration
 * built on the stack, then loaded), `g++ 12.2 -O3 -march=native` on a Xeon with AMX stored only the palette byte and
 * zeros over the first 32 bytes, and the first batched decode died with SIGILL at `ldtilecfg` (or later at
 * `tilezero`). The definition below names the whole 64 bytes as the operand, so every store reaches memory first.
 * Clang's <immintrin.h> never includes this file. */
#define _tile_loadconfig _tile_loadconfig_gcc_narrow_operand
#include_next <amxtileintrin.h>
#undef _tile_loadconfig

#if defined(__x86_64__) && defined(__AMX_TILE__)
static __inline__ __attribute__((__always_inline__, __artificial__)) void
_tile_loadconfig (const void *__config)
{
  __asm__ volatile ("ldtilecfg\t%X0" :: "m" (*(const unsigned char (*)[64]) __config));
}
#endif
