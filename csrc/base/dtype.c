/* Element types of the reductions (dtype.h): their sizes. */
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
