// The operations of score_mod / mask_mod expressions (lower/expressions.py spells a tree with them) where
// C's differ from mods/numeric.py's (NumPy's): Python's floor division and modulo, NaN-propagating min
// and max, numeric.py's sigmoid. Pasted only into kernels whose spec has an expression.

// a // b, rounded toward -inf (C's / truncates); 0 for b == 0, as NumPy's floor_divide gives.
__device__ __forceinline__ int py_floordiv(int a, int b) {
    if (b == 0) return 0;
    const int q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// a % b with the divisor's sign (C's % takes the dividend's); 0 for b == 0, as NumPy's mod gives.
__device__ __forceinline__ int py_mod(int a, int b) {
    if (b == 0) return 0;
    const int r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

// NumPy's minimum / maximum: NaN if either operand is NaN (fminf / fmaxf return the other operand).
__device__ __forceinline__ float py_minf(float a, float b) { return a != a || b != b ? a + b : fminf(a, b); }
__device__ __forceinline__ float py_maxf(float a, float b) { return a != a || b != b ? a + b : fmaxf(a, b); }

// mods/numeric.py's sigmoid: 0.5 (1 + tanh(x / 2)), which neither overflows nor loses 1 - sigmoid's digits.
__device__ __forceinline__ float py_sigmoid(float x) { return 0.5f * (1.f + tanhf(0.5f * x)); }

// A tile's class under mask_mod (schedule/tiles.py's): no visible key, some, every key visible.
constexpr int TILE_EMPTY = 0, TILE_PARTIAL = 1, TILE_FULL = 2;
