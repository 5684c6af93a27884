/* Element types of the reductions (dtype.h): their sizes and names. */
#include "base/dtype.h"

size_t uccl_dtype_size(int dtype)
{
    static const unsigned char sz[UCCL_DT_COUNT] = {
        [UCCL_DT_F32] = 4, [UCCL_DT_F64] = 8, [UCCL_DT_F16] = 2, [UCCL_DT_BF16] = 2,
        [UCCL_DT_I8] = 1, [UCCL_DT_U8] = 1, [UCCL_DT_I16] = 2, [UCCL_DT_I32] = 4,
        [UCCL_DT_I64] = 8, [UCCL_DT_BOOL] = 1,
    };
    return dtype >= 0 && dtype < UCCL_DT_COUNT ? sz[dtype] : 0;
}

const char *uccl_dtype_name(int dtype)
{
    static const char *const name[UCCL_DT_COUNT] = {
        [UCCL_DT_F32] = "float32", [UCCL_DT_F64] = "float64", [UCCL_DT_F16] = "float16",
        [UCCL_DT_BF16] = "bfloat16", [UCCL_DT_I8] = "int8", [UCCL_DT_U8] = "uint8",
        [UCCL_DT_I16] = "int16", [UCCL_DT_I32] = "int32", [UCCL_DT_I64] = "int64",
        [UCCL_DT_BOOL] = "bool",
    };
    return dtype >= 0 && dtype < UCCL_DT_COUNT ? name[dtype] : "?";
}

const char *uccl_red_name(int op)
{
    static const char *const name[UCCL_RED_COUNT] = {
        [UCCL_RED_SUM] = "SUM", [UCCL_RED_PROD] = "PRODUCT", [UCCL_RED_MIN] = "MIN",
        [UCCL_RED_MAX] = "MAX", [UCCL_RED_BAND] = "BAND", [UCCL_RED_BOR] = "BOR",
        [UCCL_RED_BXOR] = "BXOR", [UCCL_RED_AVG] = "AVG",
    };
    return op >= 0 && op < UCCL_RED_COUNT ? name[op] : "?";
}
